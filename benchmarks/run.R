# The R runner of the benchmark suite: the training loop runs in R, through the ampkit R
# package (with_autocast(), amp_grad_scaler(), amp_train_step()), on the same seeded
# models and data as the Python runner (built by ampkit.bench through reticulate), timed
# by the same protocol (see python/ampkit/bench/_runner.py) and written in the same
# schema (shared_specs/benchmarks/schema.json).
#
#   Rscript benchmarks/run.R --profile cpu --out raw-r.json \
#     [--cases a,b] [--variants x,y] [--repeats N] [--device auto|cpu|cuda] [--threads N] [--seed 0]
#
# Needs RETICULATE_PYTHON (the venv's python) and R_LIBS (where the ampkit R package is
# installed); benchmarks/run.py sets both. Exit status 2 on bad arguments.

parse_args <- function(args) {
  opts <- list(profile = "cpu", cases = "", variants = "", repeats = "", device = "auto",
               threads = "", seed = "0", out = "")
  i <- 1
  while (i <= length(args)) {
    key <- sub("^--", "", args[[i]])
    if (!startsWith(args[[i]], "--") || !(key %in% names(opts)) || i == length(args)) {
      stop_usage(sprintf("unknown or incomplete argument '%s'; valid: %s", args[[i]],
                         paste0("--", names(opts), collapse = ", ")))
    }
    opts[[key]] <- args[[i + 1]]
    i <- i + 2
  }
  if (!nzchar(opts$out)) stop_usage("--out FILE is required")
  opts
}

stop_usage <- function(msg) {
  message("error: ", msg)
  quit(save = "no", status = 2)
}

# source()d (by benchmarks/r/peak_census.R, for make_step() and make_scaler()): the CPU
# profile's plan, and nothing run; Rscript runs it (no frame above the script).
sourced <- sys.nframe() > 0L
opts <- parse_args(if (sourced) c("--device", "cpu", "--out", "-") else commandArgs(trailingOnly = TRUE))

for (pkg in c("reticulate", "ampkit")) {
  if (!requireNamespace(pkg, quietly = TRUE)) {
    stop_usage(sprintf("the R package '%s' is not installed (run `make setup-r`, and set R_LIBS=<repo>/.rlib)", pkg))
  }
}
library(ampkit)

# Start Python through the package before any reticulate::import(): it loads torch so
# that torch keeps its own BLAS (keep_torch_blas()); a torch imported by reticulate
# first binds R's reference sgemm (fp32 matmuls 15-20x slower on the CPU).
if (!ampkit_available()) {
  stop_usage("Python with torch and ampkit was not found: run `make setup` and set RETICULATE_PYTHON=<repo>/.venv/bin/python")
}

# Values may come back converted or not (objects inherit the convert flag): read both.
py_to_r <- function(x) if (inherits(x, "python.builtin.object")) reticulate::py_to_r(x) else x

bench <- reticulate::import("ampkit.bench", convert = FALSE)
torch <- reticulate::import("torch")  # converting: its callables are R functions, as for a user

# Names are checked by the same code as in Python, so the errors list the same valid names.
planned <- tryCatch(
  py_to_r(bench$plan(opts$profile, opts$cases, opts$variants)),
  error = function(e) stop_usage(conditionMessage(e)))
device <- tryCatch(py_to_r(bench$resolve_device(opts$device)),
                   error = function(e) stop_usage(conditionMessage(e)))
repeats <- if (nzchar(opts$repeats)) as.integer(opts$repeats) else NULL
if (!is.null(repeats) && (is.na(repeats) || repeats < 1)) stop_usage("--repeats must be an integer >= 1")
if (nzchar(opts$threads)) torch$set_num_threads(as.integer(opts$threads))
seed <- as.integer(opts$seed)

field <- function(obj, name) py_to_r(reticulate::py_get_attr(obj, name))
runner <- bench  # the helpers both runners share (ampkit.bench's public names)
cases <- planned[[1]]
variants <- Filter(function(v) "r" %in% unlist(field(v, "languages")), planned[[2]])

sync <- if (device == "cuda") torch$cuda$synchronize else function() invisible(NULL)
now <- function() as.numeric(Sys.time())
torch_autocast <- torch$autocast
torch_dtype <- function(name) reticulate::py_get_attr(torch, name)

# The training step of a variant, written as an R user writes it (the seeds' R walkthrough).
# `policy`: the ampkit region's cast policy (NULL: the default); an fp8 variant's is the
# tables of the one setup_fp8 installed on the model, a Python Policy, which with_autocast()
# takes as it is (build_run).
make_step <- function(v, built, model, opt, scaler, policy = NULL) {
  loss_fn <- py_to_r(built$loss_fn)
  zero_grad <- opt$zero_grad
  # Resolved once per variant, as the Python runner does: a torch dtype, or NULL (none given).
  dtype <- py_to_r(v$resolved_dtype(device))
  if (!is.null(dtype)) dtype <- torch_dtype(dtype)
  if (field(v, "runner") == "train_step") {  # the whole step in one call
    # compile: FALSE, TRUE or list(mode = ...), from the same code as in the Python runner
    # Its warning that it runs eagerly (on the CPU: always) is not printed: the record
    # carries the same reason, as in the Python runner.
    return(withCallingHandlers(
      amp_train_step(model, loss_fn, opt, scaler = scaler, device_type = device, dtype = dtype,
                     capture = field(v, "capture"), compile = py_to_r(runner$step_compile(v))),
      warning = function(w) {
        if (grepl("make_train_step: running eagerly", conditionMessage(w), fixed = TRUE))
          invokeRestart("muffleWarning")
      }))
  }
  # A compiled variant's loop calls torch.compile(model, mode = ...) (dynamo reset first),
  # made by the same code as in the Python runner.
  model <- py_to_r(runner$compile_model(v, model))
  torch_region <- function(code) with(torch_autocast(device_type = device, dtype = dtype), code)
  update <- if (is.null(scaler)) {
    function(loss) { loss$backward(); opt$step() }
  } else {
    function(loss) { scaler$scale(loss)$backward(); scaler$step(opt); scaler$update() }
  }
  # The forward in the variant's autocast region (ampkit's, torch's or none), written
  # out in each as an R user writes it, and as the Python runner writes it:
  # loss_fn(model(x), y). A bound `output` (the seed's `output <- model(x)`) keeps the
  # logits alive through backward, where Python's loop has freed them: ampkit_amp's R
  # peak on the transformer was 512 MiB (its float16 logits) above Python's on an H200
  # (ec17178); benchmarks/r/peak_census.R shows it on the CPU.
  switch(field(v, "autocast"),
    ampkit = function(x, y) {
      with_autocast(device_type = device, dtype = dtype, policy = policy, {
        loss <- loss_fn(model(x), y)
      })
      update(loss)
      zero_grad(set_to_none = TRUE)
      loss
    },
    # torch's region through reticulate's with(), by way of a function that takes the
    # block: written inline, with() kept each step's frame (and the transformer's 512 MiB
    # logits) counted until R collected, and R's peak memory went to 60 GiB (88b461e).
    torch = function(x, y) {
      torch_region({
        loss <- loss_fn(model(x), y)
      })
      update(loss)
      zero_grad(set_to_none = TRUE)
      loss
    },
    # No region. Unbound, the logits were still held through backward by their R object
    # until the next step's first module call let go of them (fp32 transformer: R's peak
    # 1.13x Python's on an H200, ec17178); the package now lets go of the outputs R
    # dropped before each call of the step (src/module.c release_dropped()).
    function(x, y) {
      loss <- loss_fn(model(x), y)
      update(loss)
      zero_grad(set_to_none = TRUE)
      loss
    })
}

# The timed epochs (step 3 of the protocol): `reps` samples of ms/step and the last
# epoch's losses. Each epoch's losses go in a list of their own and the previous epoch's
# are held until it ends, as the Python runner holds them (VariantRun.epoch's
# self.losses), and freed there, as Python frees them when their last reference goes (R
# by a collection, after the clock). A loss holds memory after backward (mse_loss's:
# its batch's errors, 8 MiB in seed_mlp's full profile): written as one list whose
# elements each step replaced, R held up to an epoch of losses fewer than Python
# (seed_mlp: R's peak 0.86x Python's on an H200, ec17178), not the same quantity.
time_epochs <- function(step, batches, reps) {
  n <- length(batches)
  samples <- numeric(reps)
  losses <- NULL
  for (r in seq_len(reps)) {
    epoch <- vector("list", n)
    sync()
    t0 <- now()
    for (i in seq_len(n)) {
      b <- batches[[i]]
      epoch[[i]] <- step(b[[1]], b[[2]])
    }
    sync()
    samples[[r]] <- (now() - t0) * 1000 / n
    previous <- !is.null(losses)
    losses <- epoch
    if (previous) amp_gc()
  }
  list(samples = samples, losses = losses)
}

make_scaler <- function(v) {
  init <- py_to_r(runner$INIT_SCALE)
  interval <- py_to_r(runner$GROWTH_INTERVAL)
  switch(field(v, "scaler"),
         none = NULL,
         torch = torch$amp$GradScaler(device, init_scale = init, growth_interval = as.integer(interval)),
         ampkit = amp_grad_scaler(device, init_scale = init, growth_interval = interval))
}

scale_of <- function(scaler) {
  if (is.null(scaler)) return(NULL)
  s <- scaler$get_scale()
  if (inherits(s, "python.builtin.object")) py_to_r(s) else as.numeric(s)
}

# A variant's model, optimizer, scaler and step, the model and optimizer as an R user holds
# them (py_to_r: callable, converting), and the case's batches as an R list.
# An fp8 variant's policy is installed first, by the Python runner's code (setup_fp8: its
# module scopes on the model, auto's calibration at the first batch), and its region takes
# that policy's own tables (`region_policy`: auto's may differ from the shipped fp8's);
# `fp8` (the installed policy, whose scopes close() removes) and `skip` (why a
# model has nothing to measure, as the Python runner says) come back with the rest.
build_run <- function(built, v) {
  model <- py_to_r(built$new_model())
  batches <- py_to_r(built$batches)
  fp8 <- NULL
  if (field(v, "fp8") != "none") {
    fp8 <- py_to_r(bench$setup_fp8(field(v, "fp8"), model, reticulate::tuple(batches[[1]][[1]]), device,
                                   torch_dtype(py_to_r(v$resolved_dtype(device)))))
    if (is.null(fp8)) {
      return(list(skip = sprintf(paste0("%s: no nn.Linear of %s can go to fp8 (its head stays in the region ",
                                        "dtype and fp8 GEMMs need dimensions that are multiples of 16): ",
                                        "nothing to measure"), field(v, "name"), py_to_r(built$name))))
    }
  }
  opt <- py_to_r(built$new_optimizer(model, fused = reticulate::py_get_attr(v, "fused_optimizer")))
  scaler <- make_scaler(v)
  policy <- if (is.null(fp8)) NULL else field(fp8, "region_policy")
  list(model = model, opt = opt, scaler = scaler, fp8 = fp8,
       step = make_step(v, built, model, opt, scaler, policy = policy), batches = batches)
}

run_variant <- function(built, v) {
  common <- list(run = bench$resolve_run(built, v, "r"))  # resolved once, as in Python
  reason <- py_to_r(v$skip_reason(device))
  if (!is.null(reason)) return(do.call(bench$make_record, c(common, status = "skipped", reason = reason)))
  t_start <- now()
  # The earlier variant's tensors are freed when R collects the objects that held
  # them: collect first, then reset the peak, so that each record's peak is its own.
  amp_gc()
  bench$reset_peak_memory(device)
  flags <- runner$precision_flags(v, device)
  flags$`__enter__`()
  on.exit(flags$`__exit__`(NULL, NULL, NULL), add = TRUE)
  tryCatch({
    run <- build_run(built, v)
    if (!is.null(run$skip)) return(do.call(bench$make_record, c(common, status = "skipped", reason = run$skip)))
    fp8 <- run$fp8
    model <- run$model; opt <- run$opt; scaler <- run$scaler; step <- run$step; batches <- run$batches
    run <- NULL
    n <- length(batches)
    # A compiled variant runs at least one warm-up step; its first compiles, timed apart.
    warmup <- py_to_r(v$warmup_steps(built$warmup_steps))
    compiled <- field(v, "compile") != "none"
    compile_s <- NULL
    counts0 <- runner$compile_counts()
    reps <- py_to_r(built$repeats)
    for (i in seq_len(warmup)) {
      b <- batches[[(i - 1) %% n + 1]]
      t0 <- now()
      step(b[[1]], b[[2]])
      if (i == 1 && compiled) {
        sync()
        compile_s <- now() - t0
      }
    }
    counts_warm <- runner$compile_counts()
    timed <- time_epochs(step, batches, reps)
    samples <- timed$samples
    losses <- timed$losses
    timed <- NULL
    final_loss <- py_to_r(built$mean_loss(losses))
    final_scale <- scale_of(scaler)
    skipped <- if (is.null(final_scale)) NULL else
      py_to_r(bench$skipped_from_scale(final_scale, built$total_steps()))
    py_step <- attr(step, "py")  # amp_train_step(): the Python TrainStep
    captured <- if (is.null(py_step)) NULL else py_to_r(reticulate::py_get_attr(py_step, "captured"))
    note <- if (is.null(py_step)) {
      py_to_r(runner$compile_note(v, warmup, counts0, counts_warm, runner$compile_counts()))
    } else {
      py_to_r(runner$train_step_note(v, py_step, warmup, counts0, counts_warm, runner$compile_counts()))
    }
    if (!is.null(fp8)) note <- paste(c(field(fp8, "note"), note), collapse = "; ")
    do.call(bench$make_record, c(common, list(
      status = "ok", samples_ms = as.list(samples), final_loss = final_loss,
      graph_captured = captured, reason = note, compile_s = compile_s,
      peak_memory_bytes = bench$peak_memory(device), final_scale = final_scale,
      skipped_steps = skipped, wall_s = now() - t_start,
      fp8_modules = if (is.null(fp8)) NULL else field(fp8, "modules"))))
  }, error = function(e) {
    # make_record keeps the head of the message, on one line, as for Python's errors
    do.call(bench$make_record, c(common, list(status = "failed", error = conditionMessage(e),
                                               wall_s = now() - t_start)))
  }, finally = {
    if (exists("fp8", inherits = FALSE) && !is.null(fp8)) fp8$scopes$remove()
    model <- opt <- scaler <- step <- losses <- fp8 <- NULL
    amp_gc()
    bench$reset_peak_memory(device)
  })
}

# A variant and its control (variants.yaml's paired_with), both planned, on the CPU (where
# pair_unit() is "step"): run together, as the Python runner runs them (VariantRun's pieces,
# ampkit.bench._pairing): both built and warmed up, then `reps` rounds of one step of each
# per batch, each timed alone, the order pair_order(i, round). Each step is a turn of its
# variant, with its own torch random state (restored before, saved after, outside the
# clock), so that a variant trains the same, step for step, paired or alone. Each round's
# sample is the variant's step times summed / num_batches; the paired variant's record has
# `paired` (pair_summary, from the same Python code). NULL when a build finds nothing to
# measure or a piece fails: the caller then runs each alone (the one that fails records its
# own error). On CUDA the R runner runs each alone (its peak memory is then each variant's
# own, and the CUDA random state needs no swapping); the GPU's paired measure of the eager
# step is benchmarks/eager_step_cost.py. `pair`: the two variants, in the group's order.
run_pair <- function(built, pair) {
  this_k <- if (identical(field(pair[[1]], "paired_with"), field(pair[[2]], "name"))) 1L else 2L
  control_k <- 3L - this_k
  commons <- lapply(pair, function(v) list(run = bench$resolve_run(built, v, "r")))
  t_start <- now()
  wall <- c(0, 0)
  amp_gc()
  bench$reset_peak_memory(device)
  rng <- list(NULL, NULL)
  # One turn of variant k: its random state and precision flags around `code`, its time
  # added to its wall_s (the pair's build and warm-up are timed per variant, as in Python).
  turn <- function(k, code) {
    t0 <- now()
    if (!is.null(rng[[k]])) torch$set_rng_state(rng[[k]])
    flags <- runner$precision_flags(pair[[k]], device)
    flags$`__enter__`()
    on.exit({
      flags$`__exit__`(NULL, NULL, NULL)
      rng[[k]] <<- torch$get_rng_state()
      wall[[k]] <<- wall[[k]] + now() - t0
    })
    force(code)
  }
  runs <- list(NULL, NULL)
  tryCatch({
    for (k in 1:2) {
      runs[[k]] <- turn(k, build_run(built, pair[[k]]))
      if (!is.null(runs[[k]]$skip)) {
        if (!is.null(runs[[1]]$fp8)) runs[[1]]$fp8$scopes$remove()
        runs <- NULL
        amp_gc()
        return(NULL)
      }
    }
    batches <- runs[[1]]$batches
    n <- length(batches)
    reps <- py_to_r(built$repeats)
    warm <- vector("list", 2)
    for (k in 1:2) warm[[k]] <- turn(k, {
      v <- pair[[k]]
      warmup <- py_to_r(v$warmup_steps(built$warmup_steps))
      compile_s <- NULL
      counts0 <- runner$compile_counts()
      for (i in seq_len(warmup)) {
        b <- batches[[(i - 1) %% n + 1]]
        t0 <- now()
        runs[[k]]$step(b[[1]], b[[2]])
        if (i == 1 && field(v, "compile") != "none") {
          sync()
          compile_s <- now() - t0
        }
      }
      list(warmup = warmup, compile_s = compile_s, counts0 = counts0, counts_warm = runner$compile_counts())
    })
    unit <- "step"
    samples <- list(numeric(reps), numeric(reps))
    this_ms <- control_ms <- numeric(0)
    losses <- list(NULL, NULL)
    for (r in seq_len(reps)) {
      rnd <- r - 1L
      epoch <- list(vector("list", n), vector("list", n))
      ms <- list(numeric(n), numeric(n))
      for (i in seq_len(n)) {
        b <- batches[[i]]
        for (k in unlist(py_to_r(bench$pair_order(i - 1L, rnd))) + 1L) turn(k, {
          t0 <- now()
          epoch[[k]][[i]] <- runs[[k]]$step(b[[1]], b[[2]])
          ms[[k]][[i]] <- (now() - t0) * 1000
        })
      }
      for (k in 1:2) samples[[k]][[r]] <- sum(ms[[k]]) / n
      this_ms <- c(this_ms, ms[[this_k]])
      control_ms <- c(control_ms, ms[[control_k]])
      previous <- !is.null(losses[[1]])
      losses <- epoch
      if (previous) amp_gc()
    }
    summary <- bench$pair_summary(field(pair[[control_k]], "name"), unit, as.list(this_ms), as.list(control_ms))
    lapply(1:2, function(k) {
      run <- runs[[k]]
      final_scale <- scale_of(run$scaler)
      skipped <- if (is.null(final_scale)) NULL else
        py_to_r(bench$skipped_from_scale(final_scale, built$total_steps()))
      py_step <- attr(run$step, "py")
      w <- warm[[k]]
      captured <- if (is.null(py_step)) NULL else py_to_r(reticulate::py_get_attr(py_step, "captured"))
      note <- if (is.null(py_step)) {
        py_to_r(runner$compile_note(pair[[k]], w$warmup, w$counts0, w$counts_warm, runner$compile_counts()))
      } else {
        py_to_r(runner$train_step_note(pair[[k]], py_step, w$warmup, w$counts0, w$counts_warm,
                                       runner$compile_counts()))
      }
      if (!is.null(run$fp8)) note <- paste(c(field(run$fp8, "note"), note), collapse = "; ")
      do.call(bench$make_record, c(commons[[k]], list(
        status = "ok", samples_ms = as.list(samples[[k]]), final_loss = py_to_r(built$mean_loss(losses[[k]])),
        graph_captured = captured, reason = note, compile_s = w$compile_s,
        peak_memory_bytes = bench$peak_memory(device), final_scale = final_scale,
        skipped_steps = skipped, wall_s = wall[[k]],
        fp8_modules = if (is.null(run$fp8)) NULL else field(run$fp8, "modules"),
        paired = if (k == this_k) summary else NULL)))
    })
  }, error = function(e) {
    NULL  # each runs alone again (run_case): the one that fails records its own error, the other its run
  }, finally = {
    for (k in 1:2) if (!is.null(runs[[k]]$fp8)) runs[[k]]$fp8$scopes$remove()
    runs <- losses <- epoch <- NULL
    amp_gc()
    bench$reset_peak_memory(device)
  })
}

# The units of a case's variants (ampkit.bench.pair_groups, as in the Python runner): a
# variant alone, or a variant and its control, at the place of the first of them; a pair
# of which one cannot run on this device runs each alone (its record says why).
run_case <- function(built, variants, emit) {
  units <- lapply(py_to_r(bench$pair_groups(variants)), function(u) unlist(u) + 1L)
  for (u in units) {
    recs <- NULL
    if (length(u) == 2 && py_to_r(bench$pair_unit(device)) == "step" && all(vapply(variants[u], function(v) is.null(py_to_r(v$skip_reason(device))),
                                     logical(1)))) {
      recs <- run_pair(built, variants[u])
    }
    if (is.null(recs)) recs <- lapply(variants[u], function(v) run_variant(built, v))
    for (rec in recs) emit(rec)
  }
}

if (!sourced) {
  records <- list()
  total <- length(cases) * length(variants)
  for (case in cases) {
    built <- bench$build_case(case, opts$profile, seed = seed, device = device,
                              repeats = if (is.null(repeats)) NULL else repeats)
    run_case(built, variants, function(rec) {
      records[[length(records) + 1]] <<- rec
      bench$progress("r", length(records), total, rec)
    })
    rm(built)
    amp_gc()
  }

  ctx <- bench$context(opts$profile, device, "r", seed = seed,
                       r_version = paste(R.version$major, R.version$minor, sep = "."),
                       reticulate_version = as.character(utils::packageVersion("reticulate")))
  invisible(bench$write_document(opts$out, ctx, records))
}
