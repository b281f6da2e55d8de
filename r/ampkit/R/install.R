#' Install ampkit's Python side (torch and the ampkit Python package)
#'
#' `install_ampkit()` creates a Python virtual environment with reticulate's
#' tools ([reticulate::virtualenv_create()]), or uses the one that exists, and
#' installs into it torch (the requirement `torch` names: from pip's index as
#' configured, which on Linux is the CUDA build unless `pip_options` names the
#' CPU index), `numpy<2` (reticulate 1.28 needs it) and the ampkit Python package, from the repository (installed
#' editable, so that it reads the repository's `shared_specs/`) or from a wheel
#' (with [reticulate::virtualenv_install()], which [reticulate::py_install()]
#' uses for virtual environments). When the R package loads, it uses that
#' environment unless `RETICULATE_PYTHON` names another Python; restart R after
#' installing if Python has already started in this session.
#'
#' The environment is found by name under reticulate's
#' [reticulate::virtualenv_root()] (the `WORKON_HOME` or
#' `RETICULATE_VIRTUALENV_ROOT` variable, else `~/.virtualenvs`), or by path
#' when `envname` contains a `/`. The option `ampkit.virtualenv` or the
#' environment variable `AMPKIT_VIRTUALENV` name another one for loading.
#'
#' @param ampkit Where the ampkit Python package comes from: the path of the
#'   ampkit repository (the folder with `pyproject.toml`) or of a wheel file.
#'   Default: the environment variable `AMPKIT_REPO`.
#' @param envname The virtual environment: a name (default `"r-ampkit"`) or a
#'   path.
#' @param torch The pip requirement for torch (default `"torch==2.13.0"`, from pip's
#'   configured index: the CPU build only where that index serves it, e.g. with
#'   `pip_options = c("--index-url", "https://download.pytorch.org/whl/cpu")`).
#' @param extra_packages Further pip requirements.
#' @param python The Python that creates a new environment (`NULL`: the one
#'   reticulate finds, such as `python3` on the `PATH`).
#' @param new_env `TRUE` removes an existing environment of that name first.
#' @param pip_options Extra options for pip, such as
#'   `c("--index-url", "https://download.pytorch.org/whl/cpu")`.
#' @return The path of the environment's Python, invisibly.
#' @seealso [ampkit_available()], [ampkit_config()]
#' @export
#' @examples
#' \dontrun{
#' install_ampkit("~/src/ampkit")   # the repository
#' install_ampkit("ampkit-0.1.0-py3-none-any.whl", envname = "~/venvs/ampkit")
#' }
install_ampkit <- function(ampkit = Sys.getenv("AMPKIT_REPO"), envname = default_envname(),
                           torch = "torch==2.13.0", extra_packages = character(),
                           python = NULL, new_env = FALSE, pip_options = character()) {
  source <- ampkit_source(ampkit)
  if (!is.character(envname) || length(envname) != 1 || is.na(envname) || !nzchar(envname)) {
    abort(sprintf("`envname` must be a virtual environment name or path, not %s.", describe(envname)),
          class = "ampkit_bad_argument")
  }
  if (!is.character(torch) || length(torch) != 1 || !grepl("^torch", torch)) {
    abort(sprintf("`torch` must be a pip requirement for torch, such as \"torch==2.13.0\", not %s.",
                  describe(torch)), class = "ampkit_bad_argument")
  }
  if (!is.character(extra_packages) || anyNA(extra_packages)) {
    abort(sprintf("`extra_packages` must be pip requirements, not %s.", describe(extra_packages)),
          class = "ampkit_bad_argument")
  }
  new_env <- as_py_bool(new_env, "new_env")
  if (new_env && reticulate::virtualenv_exists(envname)) reticulate::virtualenv_remove(envname, confirm = FALSE)
  if (!reticulate::virtualenv_exists(envname)) {
    message(sprintf("install_ampkit(): creating the virtual environment %s", envname))
    reticulate::virtualenv_create(envname, python = python, packages = NULL)
  }
  # torch first and on its own: pip then never resolves a CUDA build for ampkit's
  # own `torch` requirement.
  reticulate::virtualenv_install(envname, c(torch, "numpy<2"), pip_options = pip_options)
  # A repository is installed editable: its shared_specs/ (the policies) stay the
  # single source the package reads.
  pkg <- if (dir.exists(source)) c("-e", source) else source
  reticulate::virtualenv_install(envname, c(pkg, extra_packages), pip_options = pip_options)
  py <- reticulate::virtualenv_python(envname)
  message(sprintf(paste0("install_ampkit(): torch and ampkit are installed in %s.\n",
                         "library(ampkit) finds this environment%s."),
                  envname, if (reticulate::py_available(initialize = FALSE)) " after R restarts" else ""))
  invisible(py)
}

default_envname <- function() {
  name <- getOption("ampkit.virtualenv", Sys.getenv("AMPKIT_VIRTUALENV", "r-ampkit"))
  if (!nzchar(name)) "r-ampkit" else name
}

# The ampkit Python package for pip: a repository folder or a wheel.
ampkit_source <- function(x) {
  hint <- "Give the path of the ampkit repository (with pyproject.toml) or of an ampkit wheel, e.g. install_ampkit(\"~/src/ampkit\"), or set AMPKIT_REPO."
  if (!is.character(x) || length(x) != 1 || is.na(x) || !nzchar(x)) {
    abort(sprintf("`ampkit` must be a path, not %s. %s", describe(x), hint), class = "ampkit_bad_argument")
  }
  path <- path.expand(x)
  if (dir.exists(path) && file.exists(file.path(path, "pyproject.toml"))) return(normalizePath(path))
  if (file.exists(path) && grepl("\\.whl$", path)) return(normalizePath(path))
  abort(sprintf("`ampkit` = %s is neither an ampkit repository nor a wheel file. %s", fmt(x), hint),
        class = "ampkit_bad_argument")
}

# At load: the environment install_ampkit() made, unless the user chose a Python
# (RETICULATE_PYTHON, or Python already running). Nothing starts Python here.
use_ampkit_env <- function() {
  if (nzchar(Sys.getenv("RETICULATE_PYTHON")) || reticulate::py_available(initialize = FALSE)) {
    return(invisible(FALSE))
  }
  envname <- default_envname()
  found <- tryCatch(reticulate::virtualenv_exists(envname), error = function(e) FALSE)
  if (!isTRUE(found)) return(invisible(FALSE))
  tryCatch(reticulate::use_virtualenv(envname, required = TRUE), error = function(e) NULL)
  invisible(TRUE)
}
