// Catch2 entry point for ovq_tests.  All other tests/test_*.cpp files only
// define TEST_CASEs.
#define CATCH_CONFIG_MAIN
#include "support/catch.hpp"

#if defined(OVQ_CATCH2_V3)
// Catch2 v3 ignores CATCH_CONFIG_MAIN; provide main() ourselves.
int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
#endif
