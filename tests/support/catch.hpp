#pragma once
// The one place that knows whether Catch2 v2 (single header) or v3 (split
// headers, compiled library) is in use.  Test files include this header
// instead of Catch2 directly.

#if __has_include(<catch2/catch.hpp>)
#include <catch2/catch.hpp>
#define OVQ_CATCH2_V2 1
#elif __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define OVQ_CATCH2_V3 1
#else
#error "Catch2 not found: install Catch2 v2 (catch2/catch.hpp) or v3 (catch2/catch_all.hpp)"
#endif
