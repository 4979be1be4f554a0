#pragma once
// Library version, kept in step with project(VERSION) in CMakeLists.txt.
#define OVQ_VERSION_MAJOR 0
#define OVQ_VERSION_MINOR 1
#define OVQ_VERSION_PATCH 0

namespace ovq {
inline constexpr int kVersionMajor = OVQ_VERSION_MAJOR;
inline constexpr int kVersionMinor = OVQ_VERSION_MINOR;
inline constexpr int kVersionPatch = OVQ_VERSION_PATCH;
}  // namespace ovq
