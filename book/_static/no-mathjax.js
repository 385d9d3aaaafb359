// Loaded instead of MathJax when ci/book.py could not vendor it (no npm): formulas stay TeX source.
document.documentElement.classList.add("no-mathjax");
