/* edgepack's own builtin_fp16.h: IEEE-754 binary conversions between float widths, as the
 * templates TVM's builtin_fp16.cc instantiates (float/double -> half and half -> float).
 *
 * Template parameters: <SrcT, SrcRepT, SrcSigBits, DstT, DstRepT, DstSigBits>, where RepT is the
 * unsigned integer of the same width and SigBits the stored significand bits. Rounding is to
 * nearest, ties to even; NaNs stay (quiet) NaNs, overflow gives infinity, subnormals are handled.
 */
#ifndef EDGEPACK_BUILTIN_FP16_H_
#define EDGEPACK_BUILTIN_FP16_H_

#include <cstdint>
#include <cstring>

template <typename SrcT, typename SrcRepT, int SrcSigBits, typename DstT, typename DstRepT,
          int DstSigBits>
static inline DstT __truncXfYf2__(SrcT a) {
  static_assert(SrcSigBits > DstSigBits, "truncation narrows the significand");
  constexpr int kSrcBits = sizeof(SrcRepT) * 8;
  constexpr int kDstBits = sizeof(DstRepT) * 8;
  constexpr int kSrcExpBits = kSrcBits - SrcSigBits - 1;
  constexpr int kDstExpBits = kDstBits - DstSigBits - 1;
  constexpr int kSrcExpMax = (1 << kSrcExpBits) - 1;
  constexpr int kDstExpMax = (1 << kDstExpBits) - 1;
  constexpr int kSrcBias = kSrcExpMax >> 1;
  constexpr int kDstBias = kDstExpMax >> 1;
  constexpr int kDrop = SrcSigBits - DstSigBits;
  constexpr SrcRepT kSigMask = (SrcRepT(1) << SrcSigBits) - 1;

  SrcRepT bits;
  std::memcpy(&bits, &a, sizeof bits);
  const DstRepT sign = static_cast<DstRepT>((bits >> (kSrcBits - 1)) & 1u) << (kDstBits - 1);
  const int exp = static_cast<int>((bits >> SrcSigBits) & SrcRepT(kSrcExpMax));
  const SrcRepT sig = bits & kSigMask;
  DstRepT out;
  if (exp == kSrcExpMax) {  // infinity or NaN
    out = static_cast<DstRepT>(DstRepT(kDstExpMax) << DstSigBits);
    if (sig) out |= static_cast<DstRepT>((DstRepT(1) << (DstSigBits - 1)) | (sig >> kDrop));
  } else if (exp == 0) {  // zero or a source subnormal: far below the destination's range
    out = 0;
  } else {
    const int e = exp - kSrcBias + kDstBias;
    if (e >= kDstExpMax) {
      out = static_cast<DstRepT>(DstRepT(kDstExpMax) << DstSigBits);
    } else {
      SrcRepT full;
      int shift;
      SrcRepT base;
      if (e <= 0) {  // destination subnormal
        full = sig | (SrcRepT(1) << SrcSigBits);
        shift = kDrop + 1 - e;
        base = 0;
      } else {
        full = sig;
        shift = kDrop;
        base = SrcRepT(e) << DstSigBits;
      }
      if (shift > SrcSigBits + 1) {
        out = 0;
      } else {
        SrcRepT kept = full >> shift;
        const SrcRepT rem = full & ((SrcRepT(1) << shift) - 1);
        const SrcRepT half = SrcRepT(1) << (shift - 1);
        if (rem > half || (rem == half && (kept & 1u))) ++kept;  // may carry into the exponent
        out = static_cast<DstRepT>(base + kept);
      }
    }
  }
  out = static_cast<DstRepT>(out | sign);
  DstT result;
  std::memcpy(&result, &out, sizeof result);
  return result;
}

template <typename SrcT, typename SrcRepT, int SrcSigBits, typename DstT, typename DstRepT,
          int DstSigBits>
static inline DstT __extendXfYf2__(SrcT a) {
  static_assert(DstSigBits > SrcSigBits, "extension widens the significand");
  constexpr int kSrcBits = sizeof(SrcRepT) * 8;
  constexpr int kDstBits = sizeof(DstRepT) * 8;
  constexpr int kSrcExpBits = kSrcBits - SrcSigBits - 1;
  constexpr int kDstExpBits = kDstBits - DstSigBits - 1;
  constexpr int kSrcExpMax = (1 << kSrcExpBits) - 1;
  constexpr int kDstExpMax = (1 << kDstExpBits) - 1;
  constexpr int kSrcBias = kSrcExpMax >> 1;
  constexpr int kDstBias = kDstExpMax >> 1;
  constexpr int kWiden = DstSigBits - SrcSigBits;

  SrcRepT bits;
  std::memcpy(&bits, &a, sizeof bits);
  const DstRepT sign = static_cast<DstRepT>((bits >> (kSrcBits - 1)) & 1u) << (kDstBits - 1);
  int exp = static_cast<int>((bits >> SrcSigBits) & SrcRepT(kSrcExpMax));
  DstRepT sig = static_cast<DstRepT>(bits & ((SrcRepT(1) << SrcSigBits) - 1));
  DstRepT out;
  if (exp == kSrcExpMax) {
    out = (DstRepT(kDstExpMax) << DstSigBits) | (sig << kWiden);
  } else if (exp == 0) {
    if (sig == 0) {
      out = 0;
    } else {  // source subnormal: normalise
      int e = 1 - kSrcBias;
      while (!(sig & (DstRepT(1) << SrcSigBits))) {
        sig <<= 1;
        --e;
      }
      sig &= (DstRepT(1) << SrcSigBits) - 1;
      out = (DstRepT(e + kDstBias) << DstSigBits) | (sig << kWiden);
    }
  } else {
    out = (DstRepT(exp - kSrcBias + kDstBias) << DstSigBits) | (sig << kWiden);
  }
  out |= sign;
  DstT result;
  std::memcpy(&result, &out, sizeof result);
  return result;
}

#endif  // EDGEPACK_BUILTIN_FP16_H_
