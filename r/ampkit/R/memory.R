# GPU memory held by R garbage. A Python tensor returned to R (`output <-
# net(x)`) is freed when the R object that points to it is collected, and R
# collects when *its own* heap grows, which a training loop barely does: each
# step's outputs stay on the GPU (a 1 GiB logits tensor a step, in the
# benchmark's transformer) until R happens to collect. So the calls a loop
# makes once a step anyway (`opt$zero_grad()`, `scaler$update()` when it is not
# deferred to the next call) return the CUDA memory allocated, and R collects when it has grown past
# `ampkit.gc_threshold_mb` since the last collection (mlverse torch calls gc()
# past `torch.threshold_call_gc`). No extra Python call a step.

.mem <- new.env(parent = emptyenv())
.mem$base <- NA_real_   # bytes allocated after the last collection (or the lowest since)
.mem$collections <- 0L  # automatic collections so far
.mem$floor <- NA_real_  # bytes allocated after the last full collection

#' Free the GPU memory held by R garbage
#'
#' Python tensors returned to R (such as `output` in `output <- net(x)`) stay
#' allocated on the GPU until R's garbage collector frees the R objects that
#' hold them, and R collects only when its own heap grows, which a training
#' loop barely does. ampkit therefore watches CUDA memory at the calls a loop
#' makes once a step anyway, `opt$zero_grad()` on an optimizer and
#' `$update()` on an [amp_grad_scaler()] when it is made at once (no extra call
#' to Python; a deferred update is made in the next call, which reads it): when the
#' memory allocated by tensors has grown by more than
#' `getOption("ampkit.gc_threshold_mb", 1024)` MiB since the last collection,
#' it runs a young-generation `gc(full = FALSE)` (about a millisecond). That
#' frees every output the loop dropped except the one still live at the
#' previous collection, which R has promoted to an older generation; when
#' such leftovers have grown past `getOption("ampkit.gc_full_threshold_mb")`
#' MiB since the last full collection (by default a quarter of the card's
#' memory), a full `gc()` frees them. A full `gc()` is slow with reticulate's
#' large R heap (117 ms measured on an H200 machine, against 0.8 ms for a
#' young one), so it must be rare: with a threshold of 8 GiB, R's AMP step of
#' the benchmark's transformer took 29.4 ms against 23.6 ms with full
#' collections left to R (Python: 21.0 ms). So R holds at most about the sum
#' of the two thresholds of dead tensors (it used to be whatever R's own
#' collector left: 39.5 GiB in that transformer loop, against 17.5 GiB with
#' the watch).
#'
#' Options:
#' \describe{
#'   \item{`ampkit.gc_threshold_mb`}{Growth of CUDA memory allocated by
#'     tensors, in MiB, that triggers a young-generation collection (default
#'     1024). Lower it to keep R's peak memory closer to Python's, at the
#'     cost of more collections; `Inf` turns the automatic collection off.}
#'   \item{`ampkit.gc_full_threshold_mb`}{Growth since the last full
#'     collection, in MiB, that a young-generation collection could not free
#'     and that triggers a full one (default: a quarter of the CUDA device's
#'     memory, read once; 8192 where it cannot be read).}
#'   \item{`ampkit.release_outputs`}{`TRUE` (the default) or `FALSE`: whether
#'     the outputs of module calls (`output <- net(x)`, `loss <- loss_fn(output,
#'     y)`) that no R binding references any more are freed at the next module
#'     call, without a collection (see below).}
#' }
#'
#' Outputs R has dropped: the outputs of module calls are watched; when a later
#' step rebinds `output` and nothing else in R (R's own reference count) holds
#' the old one, the next module call lets go of R's reference to it in the same
#' call to Python (with the compiled crossing; otherwise it empties the tensor
#' when nothing in Python holds it either), so that Python frees it as it would
#' in a Python loop. With the compiled crossing, the step's other calls into
#' Python (`loss$backward()`, `scaler$scale(loss)$backward()`, `$step()`,
#' `$zero_grad()`) let go of such outputs too, before they run: a loop that
#' writes `loss <- loss_fn(net(x), y)`, as Python's `loss = loss_fn(net(x), y)`,
#' holds no logits through the backward pass. So a loop written as the seed
#' writes it holds no earlier step's outputs, with no collection at all. A
#' tensor you keep (bound to another name, stored in a list) is never freed;
#' an output passed to code that keeps a reference until R collects is left to
#' the garbage watch, whose collections stop watching the outputs first (a
#' watched output is reachable, so no collection could free it).
#'
#' Out of memory: an out-of-memory error (`torch.OutOfMemoryError`) raised by
#' a Python call that ampkit makes (entering a region, tensor and optimizer
#' methods such as `loss$backward()`, the scaler's `$scale(loss)$backward()`,
#' `$step()`, `$update()`, an [amp_train_step()] step) runs R's `gc()`,
#' Python's `gc.collect()` and `torch.cuda.empty_cache()`, then the call once
#' more (as mlverse torch retries an allocation after `gc()`). A second
#' out-of-memory error raises a condition of class
#' `c("ampkit_out_of_memory", "ampkit_py_OutOfMemoryError",
#' "ampkit_python_error", "ampkit_error", "error", "condition")`. A call that
#' changed state before it ran out of memory (a backward pass that freed its
#' graph) fails again on the retry, with that condition. An out-of-memory
#' error in R code of a region (`net(x)` is reticulate's own call) collects
#' the same way and raises that condition without a retry.
#'
#' On the CPU (or before CUDA is used) the memory reading is 0 and nothing is
#' collected. `amp_gc()` collects now: R's full `gc()`, then Python's
#' `gc.collect()` (a tensor R dropped that a Python reference cycle still held
#' is freed there, not at Python's next automatic collection).
#'
#' @return `amp_gc()` (a full collection now) returns, invisibly, a list:
#'   `allocated_before_mb` and `allocated_after_mb` (CUDA memory allocated by
#'   tensors before and after it, in MiB) and `collections` (how many
#'   automatic collections ampkit has run in this session).
#' @seealso [amp_grad_scaler()], [torch_layer]
#' @export
#' @examples
#' if (ampkit_available()) {
#'   old <- options(ampkit.gc_threshold_mb = 512)  # collect more often
#'   amp_gc()$collections
#'   options(old)
#' }
amp_gc <- function() {
  gc_threshold_bytes()
  gc_threshold_bytes("ampkit.gc_full_threshold_mb", 8192)
  py_ready()
  before <- memory_allocated()
  forget_outputs()  # a fresh start: what is still referenced is left to R's collector
  collect_memory(before, full = TRUE, automatic = FALSE)
  after <- .h$collect_garbage(empty_cache = FALSE)
  .mem$base <- after
  .mem$floor <- after
  invisible(list(allocated_before_mb = before / 2^20, allocated_after_mb = after / 2^20,
                 collections = .mem$collections))
}

memory_allocated <- function() .h$memory_allocated()

gc_threshold_bytes <- function(option = "ampkit.gc_threshold_mb", default = 1024) {
  thr <- getOption(option)
  if (is.null(thr)) thr <- if (is.function(default)) default() else default
  if (!is.numeric(thr) || length(thr) != 1L || is.na(thr) || thr < 0) {
    abort(sprintf("Option `%s` must be a number of MiB >= 0 (or Inf to turn it off), not %s.",
                  option, describe(thr)), class = "ampkit_bad_argument", call = NULL)
  }
  thr * 2^20
}

# Called with the reading returned by the hooked per-step calls: one
# comparison on the hot path.
watch_memory <- function(bytes) {
  base <- .mem$base
  # no growth (always so on the CPU); primitives only: identical() is a closure
  if (is.double(bytes) && length(bytes) == 1L && !is.na(base) && !is.na(bytes) && bytes == base) {
    return(invisible(NULL))
  }
  if (is.na(base) || bytes < base) {
    .mem$base <- bytes  # growth is measured from the lowest reading since the last collection
    if (!is.na(.mem$floor) && bytes < .mem$floor) .mem$floor <- bytes
  } else if (bytes - base > gc_threshold_bytes()) {
    collect_memory(bytes)
  }
  invisible(NULL)
}

collect_memory <- function(bytes, full = FALSE, automatic = TRUE) {
  # The rings below hold each watched output, so no collection could free one that only
  # R's garbage references (a list rebound every step that held it) while it is watched:
  # the compiled rings hold them weakly while R collects, and watch again those that
  # survive (the current step's `output`, still bound); the R rings stop watching them.
  if (.x$on) {
    .Call(.x$collecting, TRUE)
    on.exit(.Call(.x$collecting, FALSE))
  } else {
    forget_outputs()
  }
  after <- bytes
  if (!full) {
    gc(full = FALSE)
    after <- memory_allocated()
    floor <- if (is.na(.mem$floor)) 0 else .mem$floor
    full <- after - floor > gc_threshold_bytes("ampkit.gc_full_threshold_mb", full_threshold_default_mb)
  }
  if (full) {
    gc(full = TRUE)
    after <- memory_allocated()
    .mem$floor <- after
  }
  if (automatic) .mem$collections <- .mem$collections + 1L
  .mem$base <- after
  after
}

# A quarter of the card's memory (read once), 8192 MiB where it cannot be read.
full_threshold_default_mb <- function() {
  if (is.null(.mem$full_default_mb)) {
    total <- tryCatch(.h$cuda_total_memory(), error = function(e) 0)
    .mem$full_default_mb <- if (is.numeric(total) && total > 0) total / 4 / 2^20 else 8192
  }
  .mem$full_default_mb
}

# After an out-of-memory error: R's full gc() (the tensors R dropped), then
# Python's gc and torch's cache. Returns the MiB of CUDA memory freed.
free_memory <- function() {
  before <- tryCatch(memory_allocated(), error = function(e) 0)
  forget_outputs()
  gc(full = TRUE)
  after <- tryCatch(.h$collect_garbage(), error = function(e) before)
  .mem$base <- after
  .mem$floor <- after
  (before - after) / 2^20
}

# ---- the outputs of earlier steps, freed when R drops them
#
# (With the compiled crossing, src/module.c keeps these rings and applies this rule; an
# output whose Python object nothing else in R reaches is let go there rather than
# emptied through the bridge.)
#
# R frees a Python tensor when it collects the R object holding it, which can be many
# steps later (see above). The outputs of module calls (`output <- net(x)`, `loss <-
# loss_fn(output, y)`) are kept in a short list here; at the next module call, those
# that no R binding references any more (R's own reference count, which counts every
# binding, list element and attribute that points to an object, and never counts too
# few) are handed to Python in the same crossing (r_bridge.call_releasing), which
# frees the tensors that nothing in Python holds either. A tensor the user still holds
# (bound to a name, kept in a list) is left alone; so are outputs passed to functions
# that keep a reference until R collects (the garbage watch above covers those): the
# release only ever errs on the side of keeping. Option `ampkit.release_outputs`
# (default TRUE) turns it off.
#
# An output still referenced when its slot comes round again (a loss kept in a list by
# batch, `losses[[i]] <- loss`, until the next epoch replaces it) moves to a second,
# larger ring that is scanned every RELEASE_EVERY module calls: once the list lets go
# of it, it is freed a few steps later instead of at R's next full collection (a loss
# of torch's mse_loss holds the whole batch's squared errors: 8 MiB in the seed's MLP).
# A scan that frees nothing doubles the interval to the next (up to RELEASE_EVERY_MAX
# calls), so that a loop that keeps every output (a log of all losses) pays a few
# reference counts a call for watching 256 of them; one that frees something sets it
# back.

.rel <- new.env(parent = emptyenv())
# The watched outputs live in the bindings of an environment used as a ring: a
# binding replaced or cleared lowers the count of what it held, where a list copied
# to grow would count once more for every element it copied.
RELEASE_KEEP <- 16L   # outputs watched at most; older ones are left to R's collector
SLOTS <- as.character(seq_len(RELEASE_KEEP))
.rel$slots <- new.env(parent = emptyenv(), size = RELEASE_KEEP)
.rel$n <- 0L          # slots filled so far (ring position)
.rel$base <- NA_integer_  # the reference count of an object held only by its slot
.rel$released <- 0L   # outputs handed to Python for release so far
.rel$used <- logical(RELEASE_KEEP)  # which slots hold an output
.rel$on <- TRUE
# The second ring: outputs still referenced when they left the first one.
RELEASE_KEPT <- 256L  # at most; older ones are left to R's collector
RELEASE_EVERY <- 8L   # module calls between two scans of it, at first
RELEASE_EVERY_MAX <- 64L
KEPT <- paste0("k", seq_len(RELEASE_KEPT))
.rel$kept <- new.env(parent = emptyenv(), size = RELEASE_KEPT)
.rel$kn <- 0L                            # ring position
.rel$kused <- logical(RELEASE_KEPT)      # which of its slots hold an output
.rel$calls <- 0L                         # module calls since its last scan
.rel$every <- RELEASE_EVERY              # module calls between two scans now

# R's reference count of what a slot holds. refcnt() is internal to R (not API):
# R CMD check warns on .Internal() in package code, so the function is built when
# the release is calibrated, and the release stays off wherever that fails.
slot_count <- function(slots, key) .rel$refcnt(slots, key)

make_refcnt <- function() {
  eval(str2lang("function(slots, key) .Internal(refcnt(.subset2(slots, key)))"), baseenv())
}

# What an output held by nothing but its slot reads: measured on a tensor that takes
# the outputs' own path (reticulate's call, keep_output()) and is then dropped, as
# reticulate's making of the R object may count too. R >= 4.0 counts references;
# where it does not, the release stays off.
calibrate_release <- function() {
  if (isTRUE(.x$on)) return(calibrate_release_compiled())
  slots <- .rel$slots
  empty <- py_fn(py_torch$empty)
  probe <- function() {
    res <- .h$call(empty, list(0L), NULL)
    keep_output(res)
    invisible(NULL)
  }
  .rel$on <- TRUE
  .rel$base <- tryCatch({
    .rel$refcnt <- make_refcnt()
    withr::with_options(list(ampkit.release_outputs = TRUE), probe())
    slot_count(slots, SLOTS[[.rel$n]])
  }, error = function(e) NA_integer_)
  for (key in SLOTS) assign(key, NULL, envir = slots)
  .rel$n <- 0L
  .rel$used <- logical(RELEASE_KEEP)
  forget_outputs()
  .rel$on <- !is.na(.rel$base) && .rel$base >= 1L
  invisible(.rel$on)
}

keep_output <- function(x) {
  if (.rel$on && option_on("ampkit.release_outputs")) {
    k <- .rel$n %% RELEASE_KEEP + 1L
    .rel$n <- k
    used <- .rel$used
    if (used[[k]]) keep_longer(.rel$slots, SLOTS[[k]])  # still referenced: watch it longer
    assign(SLOTS[[k]], x, envir = .rel$slots)  # replaces (and lets go of) the oldest
    used[[k]] <- TRUE
    .rel$used <- used
  }
  x
}

# Move what the slot `key` holds to the second ring (replacing its oldest output,
# which is then left to R's collector). The value goes from binding to binding: no
# local variable holds it (one would count as a reference).
keep_longer <- function(slots, key) {
  j <- .rel$kn %% RELEASE_KEPT + 1L
  .rel$kn <- j
  assign(KEPT[[j]], .subset2(slots, key), envir = .rel$kept)
  kused <- .rel$kused
  kused[[j]] <- TRUE
  .rel$kused <- kused
}

# The carriers of the watched outputs that no R binding references, cleared from their
# slots; NULL when there are none (the common case costs a few R operations a slot).
dropped_outputs <- function() {
  out <- NULL
  calls <- .rel$calls + 1L
  if (calls >= .rel$every) {
    calls <- 0L
    if (any(.rel$kused)) {
      out <- dropped_kept()
      .rel$every <- if (is.null(out)) min(2L * .rel$every, RELEASE_EVERY_MAX) else RELEASE_EVERY
    }
  }
  .rel$calls <- calls
  used <- .rel$used
  at <- which(used)
  if (!length(at)) return(out)
  slots <- .rel$slots
  base <- .rel$base
  freed <- 0L
  for (k in at) {
    key <- SLOTS[[k]]
    if (slot_count(slots, key) <= base) {
      out[[length(out) + 1L]] <- py_arg(.subset2(slots, key))
      assign(key, NULL, envir = slots)
      used[[k]] <- FALSE
      freed <- freed + 1L
    }
  }
  if (freed) {
    .rel$used <- used
    .rel$released <- .rel$released + freed
  }
  out
}

# The same over the second ring (its count is added by the caller).
dropped_kept <- function() {
  kused <- .rel$kused
  kept <- .rel$kept
  base <- .rel$base
  out <- NULL
  for (j in which(kused)) {
    key <- KEPT[[j]]
    if (slot_count(kept, key) <= base) {
      out[[length(out) + 1L]] <- py_arg(.subset2(kept, key))
      assign(key, NULL, envir = kept)
      kused[[j]] <- FALSE
    }
  }
  if (!is.null(out)) {
    .rel$kused <- kused
    .rel$released <- .rel$released + length(out)
  }
  out
}

# Before a collection: let go of the watched outputs, so that the collection frees
# those that nothing else holds (those still referenced are then left to R's collector).
forget_outputs <- function() {
  if (!is.null(.x$forget)) .Call(.x$forget, FALSE)
  for (key in SLOTS[.rel$used]) assign(key, NULL, envir = .rel$slots)
  .rel$used <- logical(RELEASE_KEEP)
  for (key in KEPT[.rel$kused]) assign(key, NULL, envir = .rel$kept)
  .rel$kused <- logical(RELEASE_KEPT)
  .rel$calls <- 0L  # a fresh start: the interval learnt on what was watched goes too
  .rel$every <- RELEASE_EVERY
  invisible(NULL)
}

# The compiled twin of the above (src/module.c), calibrated the same way: the outputs of
# module calls are watched there when the compiled crossing is in use.
calibrate_release_compiled <- function() {
  forget_outputs()
  .Call(.x$forget, TRUE)
  empty <- py_fn(py_torch$empty)
  probe <- function() {
    .External(.x$module, empty, 0L)
    invisible(NULL)
  }
  base <- tryCatch({
    withr::with_options(list(ampkit.release_outputs = TRUE), probe())
    .Call(.x$calibrated)
  }, error = function(e) -1L)
  .rel$on <- base >= 1L
  invisible(.rel$on)
}

# A module call whose arguments the compiled crossing does not convert: the R path
# (through reticulate for those arguments), with the outputs the compiled rings dropped.
module_fallback <- function(obj, dead, args) {
  nm <- names(args)
  named <- if (is.null(nm)) logical(length(args)) else nzchar(nm) & !is.na(nm)
  pos <- py_args(unname(args[!named]))
  kw <- if (any(named)) py_args(args[named]) else NULL
  if (is.null(dead)) .h$call(obj, pos, kw)
  else .h$call(.h$fn$call_releasing, c(list(dead, py_arg(obj)), pos), kw)
}
