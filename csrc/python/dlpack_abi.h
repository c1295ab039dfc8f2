/* The DLPack ABI (https://dmlc.github.io/dlpack/latest/c_api.html), the parts fasttran uses:
 * the tensor descriptor, the legacy managed tensor (capsule "dltensor") and the versioned one
 * of DLPack 1.x (capsule "dltensor_versioned"). Layouts are fixed by the standard; written
 * here from the specification so the build needs no extra header. */
#ifndef FT_DLPACK_ABI_H
#define FT_DLPACK_ABI_H
#include <stdint.h>

#define FT_DLPACK_MAJOR 1
#define FT_DLPACK_MINOR 0
#define FT_DLPACK_FLAG_READ_ONLY (1ULL << 0)
#define FT_DLPACK_FLAG_IS_COPIED (1ULL << 1)

enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };
enum { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6 };

typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;      /* in elements; NULL = C order */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct { uint32_t major; uint32_t minor; } DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The fast exchange API of DLPack >= 1.2 (`type(tensor).__dlpack_c_exchange_api__`, a capsule
 * named "dlpack_exchange_api"): C functions of the producer. fasttran calls only
 * dltensor_from_py_object_no_sync, which fills a DLTensor view of a tensor object without any
 * allocation (valid until control returns to Python); the other slots are declared for the
 * layout. A consumer checks header.version.major. */
typedef struct FTDLPackExchangeAPIHeader {
    DLPackVersion version;
    struct FTDLPackExchangeAPIHeader *prev_api;
} FTDLPackExchangeAPIHeader;

typedef struct {
    FTDLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out, void *error_ctx,
                                    void (*set_error)(void *error_ctx, const char *kind, const char *message));
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor, void **out_py_object);
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);   /* may be NULL */
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_current_stream);
} FTDLPackExchangeAPI;

#endif
