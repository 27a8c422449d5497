"""CUDA runtime error numbers (``cudaError_t``) as names, for the ``ret`` of a runtime call.

Only the runtime API's numbering is here: driver calls return ``CUresult``, whose numbers
mean other things, so their ``ret`` stays a number. The list holds the errors a traced
program meets in practice; an unlisted number prints as itself.
"""

from __future__ import annotations

RUNTIME: dict[int, str] = {
    0: "cudaSuccess", 1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError", 4: "cudaErrorCudartUnloading",
    9: "cudaErrorInvalidConfiguration", 17: "cudaErrorInvalidDevicePointer",
    21: "cudaErrorInvalidMemcpyDirection", 34: "cudaErrorStubLibrary",
    35: "cudaErrorInsufficientDriver", 36: "cudaErrorCallRequiresNewerDriver",
    46: "cudaErrorDevicesUnavailable", 98: "cudaErrorInvalidDeviceFunction",
    100: "cudaErrorNoDevice", 101: "cudaErrorInvalidDevice", 200: "cudaErrorInvalidKernelImage",
    209: "cudaErrorNoKernelImageForDevice", 214: "cudaErrorECCUncorrectable",
    400: "cudaErrorInvalidResourceHandle", 500: "cudaErrorSymbolNotFound",
    600: "cudaErrorNotReady", 700: "cudaErrorIllegalAddress",
    701: "cudaErrorLaunchOutOfResources", 702: "cudaErrorLaunchTimeout",
    710: "cudaErrorAssert", 719: "cudaErrorLaunchFailure", 800: "cudaErrorNotPermitted",
    801: "cudaErrorNotSupported", 900: "cudaErrorStreamCaptureUnsupported",
    901: "cudaErrorStreamCaptureInvalidated", 999: "cudaErrorUnknown",
}


def runtime_error(ret: int) -> str | None:
    """The name of a runtime call's non-zero return, None for success or an unknown one."""
    return RUNTIME.get(ret) if ret else None
