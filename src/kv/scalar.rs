//! Scalar element codes of the KV formats: the minifloats E4M3 (OCP
//! `E4M3FN`: bias 7, no infinities, NaN = `S.1111.111`) and E2M1 (NVFP4's
//! element: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), and the integer round used by the
//! int formats. Every conversion from f32 is round-to-nearest-even of the
//! exact f32 value, saturating to the largest finite code (PTX
//! `cvt.rn.satfinite.{e4m3x2,e2m1x2}.f32`, CUDA `__nv_cvt_float_to_fp8(v,
//! __NV_SATFINITE, __NV_E4M3)`); the sign bit is the sign bit of the input,
//! so `-0.0` and negative values that round to zero encode as negative zero.
//! Callers never pass NaN or ±Inf (the row codecs poison such rows first).
//!
//! This module owns no layout: packing codes into rows is `super::codec`.

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest E2M1 value.
pub const E2M1_MAX: f32 = 6.0;

/// E4M3 code of finite `t`: round to nearest even, saturating at ±448.
pub fn e4m3_from_f32(t: f32) -> u8 {
    debug_assert!(t.is_finite(), "e4m3_from_f32: non-finite {t}");
    let sign = if t.is_sign_negative() { 0x80 } else { 0 };
    let a = t.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    let code = if a < 2f32.powi(-6) {
        // Subnormal codes m * 2^-9, m = 0..=8 (8 is the smallest normal, 0x08).
        // a * 2^9 is exact (a power-of-two scaling), so the round is of a's exact value.
        (a * 512.0).round_ties_even() as u32
    } else {
        let e = ((a.to_bits() >> 23) & 0xFF) as i32 - 127; // -6..=8
        let mant = a / 2f32.powi(e); // exact, in [1, 2)
        let m = ((mant - 1.0) * 8.0).round_ties_even() as u32; // 0..=8; 8 carries into the exponent
        (((e + 7) as u32) << 3) + m
    };
    sign | (code.min(0x7E) as u8)
}

/// The value of E4M3 code `c` (NaN for `0x7F`/`0xFF`).
pub fn e4m3_to_f32(c: u8) -> f32 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((c >> 3) & 0xF) as i32;
    let m = (c & 7) as f32;
    if e == 15 && c & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 { m * 2f32.powi(-9) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
    sign * mag
}

/// E2M1 magnitudes by code (bit 3 is the sign).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// E2M1 code (4 bits) of finite `t`: round to nearest, ties to the even code,
/// saturating at ±6.
pub fn e2m1_from_f32(t: f32) -> u8 {
    debug_assert!(t.is_finite(), "e2m1_from_f32: non-finite {t}");
    let sign = if t.is_sign_negative() { 8 } else { 0 };
    let a = t.abs();
    // Midpoints between neighbours; a tie goes to the even code.
    let code = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    sign | code
}

/// The value of E2M1 code `c` (low 4 bits).
pub fn e2m1_to_f32(c: u8) -> f32 {
    let v = E2M1_VALUES[(c & 7) as usize];
    if c & 8 != 0 {
        -v
    } else {
        v
    }
}

/// `t` rounded to the nearest integer, ties to even, clamped to `[lo, hi]`
/// (CUDA: `__float2int_rn` then clamp). `t` is finite.
pub fn round_clamp(t: f32, lo: i32, hi: i32) -> i32 {
    debug_assert!(t.is_finite(), "round_clamp: non-finite {t}");
    // Clamp in f32 first so the cast never saturates silently.
    (t.clamp(lo as f32, hi as f32).round_ties_even() as i32).clamp(lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_every_code() {
        for c in 0..=255u8 {
            if c & 0x7F == 0x7F {
                assert!(e4m3_to_f32(c).is_nan());
                continue;
            }
            let v = e4m3_to_f32(c);
            assert_eq!(e4m3_from_f32(v), c, "code {c:#04x} value {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // Between 1.0 (0x38) and 1.125 (0x39): the midpoint goes to the even code.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.0625f32.next_up()), 0x39);
        // Between 1.125 and 1.25 (0x3A): the midpoint goes up to the even code.
        assert_eq!(e4m3_from_f32(1.1875), 0x3A);
        // Carry from mantissa into exponent: 1.9375 is the midpoint of 1.875 and 2.
        assert_eq!(e4m3_from_f32(1.9375), 0x40);
        assert_eq!(e4m3_from_f32(460.0), 0x7E);
        assert_eq!(e4m3_from_f32(1e30), 0x7E);
        assert_eq!(e4m3_from_f32(-1e30), 0xFE);
        // Subnormal midpoints: 0.5 * 2^-9 ties to 0; 1.5 * 2^-9 ties to 2 * 2^-9.
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_from_f32(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(e4m3_from_f32(-1e-30), 0x80);
        assert_eq!(e4m3_from_f32(f32::from_bits(1)), 0x00);
    }

    #[test]
    fn e2m1_rounds_to_nearest_even_and_saturates() {
        let cases = [
            (0.25, 0), (0.26, 1), (0.75, 2), (1.25, 2), (1.3, 3), (1.75, 4), (2.5, 4), (2.6, 5),
            (3.5, 6), (5.0, 6), (5.01, 7), (100.0, 7), (-0.1, 8), (-6.0, 15),
        ];
        for (t, c) in cases {
            assert_eq!(e2m1_from_f32(t), c, "t = {t}");
        }
        for c in 0..16u8 {
            assert_eq!(e2m1_from_f32(e2m1_to_f32(c)), if c == 8 { 8 } else { c });
        }
    }

    #[test]
    fn round_clamp_ties_to_even() {
        assert_eq!(round_clamp(2.5, -7, 7), 2);
        assert_eq!(round_clamp(-2.5, -7, 7), -2);
        assert_eq!(round_clamp(3.5, -7, 7), 4);
        assert_eq!(round_clamp(7.6, -7, 7), 7);
        assert_eq!(round_clamp(-1e30, -127, 127), -127);
    }
}
