#pragma once
// Catch2 matchers shared by the tests (v2 and v3 spell the matcher base differently).
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/catch.hpp"

namespace ovq::test {

#if defined(OVQ_CATCH2_V3)
template <class T>
using MatcherBaseT = Catch::Matchers::MatcherBase<T>;
#else
template <class T>
using MatcherBaseT = Catch::MatcherBase<T>;
#endif

// Matches an exception whose what() contains every one of the given pieces.
class MessageHas : public MatcherBaseT<std::exception> {
 public:
  MessageHas(std::initializer_list<std::string> pieces) : pieces_(pieces) {}

  bool match(const std::exception& e) const override {
    const std::string what = e.what();
    for (const std::string& p : pieces_)
      if (what.find(p) == std::string::npos) return false;
    return true;
  }

  std::string describe() const override {
    std::string out = "has a message containing";
    for (const std::string& p : pieces_) out += " \"" + p + "\"";
    return out;
  }

 private:
  std::vector<std::string> pieces_;
};

}  // namespace ovq::test
