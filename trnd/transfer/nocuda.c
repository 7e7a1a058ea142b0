/* No-device stand-ins for the CUDA driver and runtime symbols that NIXL's LIBFABRIC plugin (from the
 * nixl-cu* wheels) links. The plugin calls them only for VRAM registrations; a DRAM pool never does.
 * transfer/backends.py builds this once per soname, and only where no real library of that name loads
 * (a CPU or Trainium host has no CUDA driver). Every call reports CUDA's "no device" (100). */
int cuCtxSetCurrent(void *ctx) { (void)ctx; return 100; }
int cuDeviceGetPCIBusId(char *buf, int len, int dev) { (void)buf; (void)len; (void)dev; return 100; }
int cuPointerGetAttributes(unsigned n, int *attrs, void **data, unsigned long long ptr) {
    (void)n; (void)attrs; (void)data; (void)ptr; return 100;
}
int cudaSetDevice(int dev) { (void)dev; return 100; }
const char *cudaGetErrorString(int err) { (void)err; return "no CUDA device (trnd's stand-in, transfer/nocuda.c)"; }
