// The AMX tile state both AMX kernels (csrc/prefill_amx.cpp, csrc/linear.cpp's linear_amx) run under: Linux's
// permission for it and the one tile configuration they share, all eight tiles 16 rows x 64 bytes.
// AVX-512 build only; the AMX instructions are enabled per function (target attribute).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace trnd {

inline bool amx_permitted() {
  // Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
  // once granted it holds for the whole process.
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Per thread, before its first tile instruction (the configuration is thread state).
__attribute__((target("amx-tile"))) inline void load_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  // GCC 12 drops the stores above as dead (it does not see ldtilecfg read them): this barrier keeps them
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

}  // namespace trnd
#endif
