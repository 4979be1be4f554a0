#pragma once
#include "ovq/version.hpp"
