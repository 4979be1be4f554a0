// Compiled into every program of a sanitized build (OVQ_SANITIZE) and into the fuzz targets: the
// sanitizers' defaults, which UBSAN_OPTIONS in the environment can still override key by key.
//
// UndefinedBehaviorSanitizer's checks are compiled in their recoverable form (a handler that
// returns), which compiles faster than the aborting form in the kernels' unrolled loops;
// halt_on_error makes the first finding fatal all the same, so that a report fails the test
// (tests/ubsan_halts.cpp checks it), and a fuzz target saves the input that caused it.
extern "C" const char* __ubsan_default_options() { return "halt_on_error=1:print_stacktrace=1"; }
