/* The CPU backend's services and ops, cpu_<name> for every entry of the op list (backend.h);
 * one file per op family, the table in backend_cpu.c. */
#ifndef FT_CPU_OPS_H
#define FT_CPU_OPS_H
#include <string.h>

#include "backend.h"

#define FT_CPU_SERVICE(ret, name, params) ret cpu_##name params;
#define FT_CPU_OP(name, params, args) ft_status cpu_##name params;
FT_BACKEND_SERVICES(FT_CPU_SERVICE)
FT_BACKEND_OPS(FT_CPU_OP)
#undef FT_CPU_SERVICE
#undef FT_CPU_OP
#endif
