// The moeforge algebra in one include.
#pragma once

#include "dsl/autodiff.h"
#include "dsl/check.h"
#include "dsl/dtype.h"
#include "dsl/error.h"
#include "dsl/ir.h"
#include "dsl/losses.h"
#include "dsl/ops.h"
#include "dsl/pipeline.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
