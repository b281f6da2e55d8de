# The seed walkthrough as chunks of code, with the device strings and the
# sizes changed (and nothing else), ready to run on `device`.
seed_chunks <- function(device = "cpu", sizes = c(batch_size = 8, in_size = 16, out_size = 16,
                                                   num_layers = 3, num_batches = 3, epochs = 2)) {
  lines <- readLines(test_path("fixtures", "seed-walkthrough.R"))
  text <- gsub("\"cuda\"", paste0("\"", device, "\""), lines, fixed = TRUE)
  for (n in names(sizes)) {
    text <- sub(paste0("^", n, " <- [0-9]+"), paste(n, "<-", sizes[[n]]), text)
  }
  starts <- grep("^# ---- ", text)
  chunks <- Map(function(a, b) paste(text[a:b], collapse = "\n"),
                starts + 1, c(starts[-1] - 1, length(text)))
  structure(chunks, names = sub("^# ---- ", "", text[starts]), changed = sum(text != lines))
}

# The same walkthrough driven from Python: the golden values.
seed_walkthrough_py <- function(device, sizes) sprintf("
import torch, ampkit
torch.manual_seed(1)
batch_size, in_size, out_size, num_layers, num_batches, epochs = %d, %d, %d, %d, %d, %d
device = %s
data = [torch.randn(batch_size, in_size, device=device) for _ in range(num_batches)]
targets = [torch.randn(batch_size, out_size, device=device) for _ in range(num_batches)]

def make_model(in_size, out_size, num_layers):
    layers = []
    for i in range(num_layers - 1):
        layers += [torch.nn.Linear(in_size, in_size), torch.nn.ReLU()]
    layers += [torch.nn.Linear(in_size, out_size)]
    return torch.nn.Sequential(*layers).to(device)

def run(autocast, scale):
    loss_fn = torch.nn.MSELoss()
    net = make_model(in_size, out_size, num_layers)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ampkit.cuda_amp_grad_scaler(enabled=scale) if scale is not None else None
    for epoch in range(epochs):
        for i in range(len(data)):
            with ampkit.autocast(device, enabled=autocast):
                output = net(data[i])
                loss = loss_fn(output, targets[i])
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
    return loss.item()
", sizes[["batch_size"]], sizes[["in_size"]], sizes[["out_size"]], sizes[["num_layers"]],
   sizes[["num_batches"]], sizes[["epochs"]], deparse(device))
