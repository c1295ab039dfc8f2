// fasttran's CUDA emulator: checks callable from device-side headers.
#ifndef FTEMU_CHECK_H
#define FTEMU_CHECK_H
#include "ftemu.h"
namespace ftemu {
// a wmma operation: waits until every lane of the warp has arrived (checked like any warp
// operation with FASTTRAN_EMU_CHECK=barriers)
void wmma_arrive(const char *file, int line);
// a wmma load or store's operand as the CUDA documentation requires it: the pointer 256-bit
// (32-byte) aligned, ldm a multiple of 16 bytes (8 halves, 4 floats); else the launch fails
// (a GPU faults or computes garbage)
void wmma_operand(const void *p, unsigned ldm, size_t elem_bytes, const char *what, const char *file, int line);
}
#endif
