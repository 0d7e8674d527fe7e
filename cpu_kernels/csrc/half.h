// fp16 and bf16 bits <-> fp32, one value at a time: the portable forms of the conversions (runtime.cc converts
// arrays with AVX-512 or F16C where the CPU has them; the tails of those loops and a CPU without them use these).
// An fp32 value past fp16's range becomes inf, as MindSpore's Cast makes it, so the loss scale's overflow check
// still sees it; both roundings are to nearest even.
#pragma once
#include <cstdint>
#include <cstring>

// fp16 bits -> fp32, exact (subnormals normalised)
inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while (!(m & 0x400u));
    bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// fp32 -> fp16 bits, rounded to nearest even
inline uint16_t FloatToHalfBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0);  // inf, NaN
  if (x >= 0x477ff000u) return sign | 0x7c00u;                                    // rounds past 65504: inf
  if (x < 0x38800000u) {  // an fp16 subnormal or zero: add 0.5 to land the bits in place, rounding to even
    float a;
    std::memcpy(&a, &x, 4);
    a += 0.5f;
    uint32_t b;
    std::memcpy(&b, &a, 4);
    return sign | static_cast<uint16_t>(b - 0x3f000000u);
  }
  const uint32_t odd = (x >> 13) & 1;
  x += 0xc8000fffu + odd;  // rebias the exponent (-112 << 23) and round to nearest even
  return sign | static_cast<uint16_t>(x >> 13);
}

// fp16 or fp32 -> bf16 bits, rounded to nearest even (only where CpuCompute is bf16: the CPU has AVX512-BF16)
inline uint16_t FloatToBf16Bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}
