# The seed's AMP benchmark as written (r/ampkit/tests/testthat/fixtures/seed-walkthrough.R,
# the R seed verbatim with library(ampkit)), and its Python twin: shared by
# profile_seed.R (CPU profile, since deleted) and benchmarks/gpu/r_seed_loop.R (GPU).
#
#   source("benchmarks/r/seed_loop.R")
#   seed <- seed_loop(device = "cpu", sizes = c(batch_size = 8, in_size = 16, ...))
#   seed$run(autocast = TRUE, scale = TRUE)      # the seed's run(), in a fresh environment
#   seed$py_run(autocast = TRUE, scale = TRUE)   # the same loop in Python, same data
#
# Changed from the seed, and nothing else: the sizes, the device strings ("cuda" ->
# `device`) and, off CUDA, cuda_amp_grad_scaler( -> amp_grad_scaler(<device>, (on the
# CPU the CUDA scaler is disabled, and the scaler's path would not run).

seed_fixture <- function(repo = Sys.getenv("AMPKIT_REPO", ".")) {
  path <- file.path(repo, "r", "ampkit", "tests", "testthat", "fixtures", "seed-walkthrough.R")
  if (!file.exists(path)) stop("the seed fixture is not at ", path, ": run from the repository root or set AMPKIT_REPO")
  readLines(path)
}

seed_loop <- function(device = "cuda", sizes = NULL, repo = Sys.getenv("AMPKIT_REPO", ".")) {
  text <- gsub("\"cuda\"", paste0("\"", device, "\""), seed_fixture(repo), fixed = TRUE)
  if (device != "cuda") {
    text <- gsub("cuda_amp_grad_scaler(", sprintf("amp_grad_scaler(\"%s\", ", device), text, fixed = TRUE)
  }
  for (n in names(sizes)) text <- sub(paste0("^", n, " <- [0-9]+"), paste(n, "<-", sizes[[n]]), text)
  starts <- grep("^# ---- ", text)
  chunks <- Map(function(a, b) paste(text[a:b], collapse = "\n"), starts + 1, c(starts[-1] - 1, length(text)))
  names(chunks) <- sub("^# ---- ", "", text[starts])
  env <- new.env(parent = globalenv())
  for (name in c("setup", "data", "model")) eval(parse(text = chunks[[name]]), env)
  # the benchmark chunk's run() definition (its system.time() calls are the caller's)
  exprs <- parse(text = chunks[["benchmark"]])
  is_run <- vapply(exprs, function(e) is.call(e) && identical(e[[2]], as.name("run")), logical(1))
  eval(exprs[[which(is_run)[[1]]]], env)
  reticulate::py_run_string(SEED_TWIN_PY)
  twin <- reticulate::import_main()$seed_twin
  list(
    env = env,
    run = env$run,
    py_run = function(autocast, scale) {
      twin(autocast, scale, env$data, env$targets, as.integer(env$in_size), as.integer(env$out_size),
           as.integer(env$num_layers), as.integer(env$epochs), device)
    },
    steps = length(env$data) * env$epochs
  )
}

# The seed's run() in Python: the same calls, on the data the R code made.
SEED_TWIN_PY <- "
import torch, ampkit.r_bridge

def seed_twin(autocast, scale, data, targets, in_size, out_size, num_layers, epochs, device):
    layers = []
    for i in range(num_layers - 1):
        layers += [torch.nn.Linear(in_size, in_size), torch.nn.ReLU()]
    layers += [torch.nn.Linear(in_size, out_size)]
    net = torch.nn.Sequential(*layers).to(device)
    losses, _ = ampkit.r_bridge.amp_loop(net, list(zip(data, targets)), device, autocast, scale,
                                         epochs * len(data), lr=0.1)
    return losses[-1]
"
