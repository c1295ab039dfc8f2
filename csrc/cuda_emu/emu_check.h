// fasttran's CUDA emulator: checks callable from device-side headers.
#ifndef FTEMU_CHECK_H
#define FTEMU_CHECK_H
#include "ftemu.h"
namespace ftemu {
// a wmma operation: waits until every lane of the warp has arrived (checked like any warp
// operation with FASTTRAN_EMU_CHECK=barriers)
void wmma_arrive(const char *file, int line);
}
#endif
