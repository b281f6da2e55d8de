# The seed's AMP step, N times, driven from R or (the twin) from Python in the same R
# process, for a sampling profiler that splits the process's time by library:
#
#   RETICULATE_PYTHON=<repo>/.venv/bin/python R_LIBS=<repo>/.rlib OMP_NUM_THREADS=1 \
#     perf record -o perf-r.data Rscript benchmarks/r/step_perf.R r
#   ... perf record -o perf-py.data Rscript benchmarks/r/step_perf.R py
#   perf report -i perf-r.data -n --no-children --sort dso --stdio -g none
#
# The two runs share R's start-up (loading R, reticulate, torch); the difference of the
# sample counts per library over the steps is where R's extra time per step goes.
# Prints the CPU time per step (user + system) of the loop.
library(ampkit); stopifnot(ampkit_available())
torch <- reticulate::import("torch"); torch$set_num_threads(1L)
mode <- commandArgs(trailingOnly = TRUE)[[1]]  # "r" or "py"
torch_manual_seed(1)
data <- lapply(1:10, function(i) torch_randn(8, 16)); targets <- lapply(1:10, function(i) torch_randn(8, 16))
net <- nn_sequential(nn_linear(16,16), nn_relu(), nn_linear(16,16), nn_relu(), nn_linear(16,16))
loss_fn <- nn_mse_loss(); opt <- optim_sgd(net$parameters, lr = 0.1)
scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
run <- function(n) for (s in seq_len(n)) {
  i <- (s - 1L) %% 10L + 1L
  with_autocast(device_type = "cpu", { output <- net(data[[i]]); loss <- loss_fn(output, targets[[i]]) })
  scaler$scale(loss)$backward(); scaler$step(opt); scaler$update(); opt$zero_grad()
}
reticulate::py_run_string("
import torch, ampkit
def py_run(net, data, targets, n):
    loss_fn = torch.nn.MSELoss(); opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ampkit.GradScaler('cpu', init_scale=2.0**10)
    for s in range(n):
        i = s % 10
        with ampkit.autocast('cpu'):
            output = net(data[i]); loss = loss_fn(output, targets[i])
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
")
N <- as.integer(Sys.getenv("STEPS", "6000"))
if (mode == "r") { run(300); t <- system.time(run(N)) } else { m <- reticulate::import_main(); m$py_run(net, data, targets, 300L); t <- system.time(m$py_run(net, data, targets, N)) }
cat(mode, "cpu us/step:", (t[["user.self"]] + t[["sys.self"]]) / N * 1e6, "\n")
