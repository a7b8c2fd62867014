"""The per-device runtime every backend runs: the interpreter of a device's lowered
program, the worker around it (microbatches, gradient sums, the optimizer update, the
resident state), the transport interface between devices, timing and bounded waits."""
