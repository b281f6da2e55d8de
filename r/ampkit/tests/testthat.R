# Python-backed tests: they skip (with a reason) when Python, torch, the
# ampkit Python package or the repository (AMPKIT_REPO) cannot be found.
library(testthat)
library(ampkit)

test_check("ampkit")
