// fasttran's CUDA emulator: cuda_bf16.h (see ftemu.h and ftemu_half.h)
#pragma once
#include "cuda_runtime.h"
#include "ftemu_half.h"
