# The seed's AMP step at small CPU sizes (batches of 8 x 16, three Linear(16, 16)), as an R
# user writes it: data, targets, net, loss_fn, opt, scaler and step(i), defined where this
# file is sourced (at top level: the scripts' own globals). Sourced by crossing.R,
# step_rside.R and instructions.R:
#   source(file.path(Sys.getenv("AMPKIT_REPO", "."), "benchmarks", "r", "small_step.R"))
torch_manual_seed(1)
data <- lapply(1:10, function(i) torch_randn(8, 16))
targets <- lapply(1:10, function(i) torch_randn(8, 16))
net <- nn_sequential(nn_linear(16, 16), nn_relu(), nn_linear(16, 16), nn_relu(), nn_linear(16, 16))
loss_fn <- nn_mse_loss()
opt <- optim_sgd(net$parameters, lr = 0.1)
scaler <- amp_grad_scaler("cpu", init_scale = 2^10)
step <- function(i) {
  with_autocast(device_type = "cpu", {
    output <- net(data[[i]])
    loss <- loss_fn(output, targets[[i]])
  })
  scaler$scale(loss)$backward()
  scaler$step(opt)
  scaler$update()
  opt$zero_grad()
}
