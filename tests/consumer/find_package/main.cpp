#include <ovq/ovq.hpp>

int main() { return ovq::kVersionMajor == 0 ? 0 : 1; }
