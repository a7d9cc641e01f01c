//! Edge and round-trip tests of every row codec and the format table.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::codec::{align_row, sum_sq_lanes, POISON_SCALE};
use super::scalar::e4m3_to_f32;
use super::*;

/// Every codec the table uses, plus fp16 and both rotations of every scaled code.
fn all_codecs() -> Vec<RowCodec> {
    use ElemCodec::*;
    let mut v = vec![RowCodec::new(F32, false), RowCodec::new(Bf16, false), RowCodec::new(Fp16, false)];
    for e in [Int8, Fp8, Nvfp4, Int4G32, Int2G32, Vq2] {
        v.push(RowCodec::new(e, false));
        v.push(RowCodec::new(e, true));
    }
    v
}

fn gaussian_row(rng: &mut ChaCha8Rng, d: usize, sigma: f32) -> Vec<f32> {
    (0..d)
        .map(|_| {
            let u1: f64 = rng.gen_range(1e-12..1.0);
            let u2: f64 = rng.gen();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32 * sigma
        })
        .collect()
}

fn round_trip(c: &RowCodec, x: &[f32]) -> (Vec<u8>, Vec<f32>, usize) {
    let mut b = vec![0xAAu8; c.row_bytes(x.len())];
    let n_bad = c.encode_row(x, &mut b).unwrap();
    let mut y = vec![f32::NAN; x.len()];
    c.decode_row(&b, &mut y).unwrap();
    (b, y, n_bad)
}

fn get_f32(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

fn amax(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, &x| m.max(x.abs()))
}

/// The stated per-element error bound of an unrotated codec for element `i`
/// of `x`, encoded as `b`. `None` for vq2 (it has a row MSE bound instead).
fn elem_bound(c: &RowCodec, x: &[f32], b: &[u8], i: usize) -> Option<f32> {
    assert!(!c.rotate);
    let d = x.len();
    let xi = x[i].abs();
    let tiny = 2f32.powi(-147);
    let fudge = |amax: f32| amax * 2f32.powi(-20) + tiny;
    let e = c.elem;
    let data = e.data_bytes(d);
    Some(match e {
        ElemCodec::F32 => 0.0,
        ElemCodec::Bf16 => xi * 2f32.powi(-8) + 2f32.powi(-133),
        ElemCodec::Fp16 => xi * 2f32.powi(-11) + 2f32.powi(-25),
        ElemCodec::Int8 => 0.5 * get_f32(b, data) + fudge(amax(x)),
        ElemCodec::Fp8 => (xi * 2f32.powi(-4)).max(get_f32(b, data) * 2f32.powi(-10)) + fudge(amax(x)),
        ElemCodec::Nvfp4 => {
            let bs = e4m3_to_f32(b[data + 4 + i / 16]);
            let eff = bs * get_f32(b, data);
            let f = fudge(amax(x));
            if bs >= 2f32.powi(-6) {
                (0.25 * eff).max(0.25 * xi) + f
            } else {
                xi + eff + f
            }
        }
        ElemCodec::Int4G32 | ElemCodec::Int2G32 => {
            let s = get_f32(b, data + 4 * (i / 32));
            0.5 * s + fudge(amax(&x[i / 32 * 32..i / 32 * 32 + 32]))
        }
        ElemCodec::Vq2 => return None,
    })
}

/// Asserts the codec's stated error bound on `x`: per element for the
/// unrotated codecs, for vq2 a relative row MSE of at most `vq_rel_mse`;
/// a rotated codec is exactly the unrotated one applied to `H x`.
fn assert_within_bound(c: &RowCodec, x: &[f32], vq_rel_mse: f64) {
    let (b, y, n_bad) = round_trip(c, x);
    assert_eq!(n_bad, 0, "{}", c.name());
    if c.rotate {
        let plain = RowCodec::new(c.elem, false);
        let mut hx = x.to_vec();
        hadamard::forward(&mut hx);
        let (pb, mut py, _) = round_trip(&plain, &hx);
        assert_eq!(b, pb, "{}: rotated encode is the plain encode of H x", c.name());
        hadamard::inverse(&mut py);
        assert_eq!(y, py, "{}: rotated decode is H⁻¹ of the plain decode", c.name());
        assert_within_bound(&plain, &hx, vq_rel_mse);
        return;
    }
    if c.elem == ElemCodec::Vq2 {
        let err: f64 = x.iter().zip(&y).map(|(&a, &b)| ((a - b) as f64).powi(2)).sum();
        let energy: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
        assert!(err <= vq_rel_mse * energy + 1e-30, "{}: relative MSE {}", c.name(), err / energy);
        return;
    }
    for i in 0..x.len() {
        let bound = elem_bound(c, x, &b, i).unwrap();
        let e = (x[i] - y[i]).abs();
        assert!(e <= bound, "{}: element {i}: {} -> {} (error {e}, bound {bound})", c.name(), x[i], y[i]);
    }
}

#[test]
fn row_bytes_are_the_documented_layouts() {
    use ElemCodec::*;
    // (codec, bytes for d = 64, bytes for d = 256)
    let cases = [
        (F32, 256, 1024),
        (Bf16, 128, 512),
        (Fp16, 128, 512),
        (Int8, 80, 272),
        (Fp8, 80, 272),
        (Nvfp4, 48, 160),
        (Int4G32, 48, 160),
        (Int2G32, 32, 96),
        (Vq2, 32, 80),
    ];
    for (e, b64, b256) in cases {
        for rotate in [false, true] {
            let c = RowCodec::new(e, rotate);
            assert_eq!(c.row_bytes(64), b64, "{}", c.name());
            assert_eq!(c.row_bytes(256), b256, "{}", c.name());
            assert_eq!(c.row_bytes(96) % 16, 0);
            let used = e.data_bytes(96) + 4 * e.f32_scale_count(96) + e.u8_scale_count(96);
            assert_eq!(c.row_bytes(96), align_row(used));
        }
    }
}

#[test]
fn table_bytes_per_position_and_names() {
    // SmolLM2-135M: 3 KV heads of 64.
    let expect = [
        (KvFormat::F32, 1536),
        (KvFormat::Bf16, 768),
        (KvFormat::Int8, 480),
        (KvFormat::Fp8, 480),
        (KvFormat::K8v4, 384),
        (KvFormat::Nvfp4, 288),
        (KvFormat::K4v2, 240),
        (KvFormat::Vq2, 192),
    ];
    for (f, bytes) in expect {
        assert_eq!(f.bytes_per_position_per_layer(3, 64, 64), bytes, "{f}");
        assert_eq!(f.name().parse::<KvFormat>().unwrap(), f);
    }
    // Widest first: bytes never grow along ALL.
    let b: Vec<usize> = KvFormat::ALL.iter().map(|f| f.bytes_per_position_per_layer(1, 256, 256)).collect();
    assert!(b.windows(2).all(|w| w[0] >= w[1]), "{b:?}");
    let err = "fp4".parse::<KvFormat>().unwrap_err().to_string();
    assert!(err.contains("fp4") && err.contains("nvfp4") && err.contains("k4v2"), "{err}");
    assert!(!KvFormat::F32.is_quantized() && !KvFormat::Bf16.is_quantized());
    assert!(KvFormat::ALL[2..].iter().all(|f| f.is_quantized()));
    // Only scaled codes are rotated.
    for f in KvFormat::ALL {
        for c in [f.k(), f.v()] {
            assert!(!c.rotate || c.elem.is_scaled(), "{f}: {}", c.name());
        }
    }
}

#[test]
fn lengths_are_checked() {
    let c = KvFormat::Fp8.k();
    assert!(c.check_len(48).unwrap_err().to_string().contains("48"));
    assert!(c.check_len(0).is_err());
    assert!(KvFormat::Bf16.k().check_len(48).is_ok());
    let mut b = vec![0u8; 79];
    assert!(c.encode_row(&[0.0; 64], &mut b).is_err());
    let mut y = vec![0.0; 64];
    assert!(c.decode_row(&b, &mut y).is_err());
    assert!(KvFormat::Vq2.check_dims(64, 96).is_ok());
    assert!(KvFormat::Vq2.check_dims(64, 80).is_err());
}

#[test]
fn all_zeros_decode_to_zero() {
    for c in all_codecs() {
        let (b, y, n_bad) = round_trip(&c, &[0.0; 64]);
        assert_eq!(n_bad, 0);
        assert!(y.iter().all(|&v| v == 0.0), "{}: {y:?}", c.name());
        // The padding is zero and so is every scale.
        assert!(b[c.elem.data_bytes(64)..].iter().all(|&v| v == 0), "{}", c.name());
    }
}

#[test]
fn all_equal_rows() {
    for v in [0.3712f32, -5.25e3, 1.0, 7e-30] {
        let x = vec![v; 64];
        for c in all_codecs() {
            // vq2 has no bound on such adversarial rows beyond never exceeding the row's energy.
            assert_within_bound(&c, &x, 1.0);
        }
        // int8 and fp8 without rotation hit their top code exactly.
        for e in [ElemCodec::Int8, ElemCodec::Fp8] {
            let (b, y, _) = round_trip(&RowCodec::new(e, false), &x);
            assert!(y.iter().all(|&t| t == y[0]));
            assert_eq!(b[0], if e == ElemCodec::Int8 { (127i8 * v.signum() as i8) as u8 } else { 0x7E | (b[0] & 0x80) });
        }
    }
}

#[test]
fn maxima_are_coded_or_counted() {
    let mut x = vec![0.0f32; 64];
    for (i, t) in x.iter_mut().enumerate() {
        *t = if i % 3 == 0 { f32::MAX } else if i % 3 == 1 { -f32::MAX } else { 1.5 };
    }
    for c in all_codecs() {
        let (_, y, n_bad) = round_trip(&c, &x);
        match c.elem {
            ElemCodec::F32 => assert_eq!(y, x),
            // bf16 and fp16 overflow to ±Inf element by element, and say so.
            ElemCodec::Bf16 | ElemCodec::Fp16 => {
                assert_eq!(n_bad, 2 * 64 / 3 + 1);
                assert!(y[0] == f32::INFINITY && y[1] == f32::NEG_INFINITY && y[2] == 1.5);
            }
            // Without rotation: coded if QMAX * scale stays finite (fp8 here), else poisoned (int8).
            _ if !c.rotate && c.elem != ElemCodec::Vq2 && n_bad == 0 => {
                assert_ne!(c.elem, ElemCodec::Int8);
                assert!(y.iter().all(|v| v.is_finite()), "{}: {y:?}", c.name());
                assert_within_bound(&c, &x, 0.0);
            }
            // The rotation, the RMS or QMAX * scale overflow: the row is poisoned and counted.
            _ => {
                assert_ne!(c, RowCodec::new(ElemCodec::Fp8, false));
                assert_eq!(n_bad, 64, "{}", c.name());
                assert!(y.iter().all(|v| v.is_nan()), "{}", c.name());
            }
        }
    }
    // One order of magnitude below: every unrotated scaled codec codes it finitely.
    for t in x.iter_mut() {
        *t = (*t / 10.0).clamp(-3.4e37, 3.4e37);
    }
    for c in all_codecs() {
        if !c.rotate && c.elem.is_scaled() && c.elem != ElemCodec::Vq2 {
            let (_, y, n_bad) = round_trip(&c, &x);
            assert_eq!(n_bad, 0, "{}", c.name());
            assert!(y.iter().all(|v| v.is_finite()), "{}: {y:?}", c.name());
            assert_within_bound(&c, &x, 0.0);
        }
    }
}

#[test]
fn subnormal_rows() {
    let x: Vec<f32> = (0..64).map(|i| f32::from_bits(1 + 997 * i as u32) * if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
    assert!(x.iter().all(|v| v.is_subnormal()));
    for c in all_codecs() {
        let (_, y, n_bad) = round_trip(&c, &x);
        assert_eq!(n_bad, 0, "{}", c.name());
        assert!(y.iter().all(|v| v.is_finite()));
        // vq2's sum of squares underflows to 0: the row decodes to zeros (relative MSE 1).
        assert_within_bound(&c, &x, 1.0);
    }
    // f32 keeps subnormals exactly; bf16 has f32's exponent range.
    assert_eq!(round_trip(&KvFormat::F32.k(), &x).1, x);
}

#[test]
fn non_finite_inputs_poison_scaled_rows_and_are_counted() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut x = gaussian_row(&mut rng, 64, 1.0);
    x[5] = f32::NAN;
    x[40] = f32::NEG_INFINITY;
    for c in all_codecs() {
        let (b, y, n_bad) = round_trip(&c, &x);
        assert_eq!(n_bad, 2, "{}", c.name());
        if c.elem.is_scaled() {
            assert!(y.iter().all(|v| v.is_nan()), "{}", c.name());
            let e = c.elem;
            assert!(b[..e.data_bytes(64)].iter().all(|&v| v == 0));
            for i in 0..e.f32_scale_count(64) {
                assert_eq!(get_f32(&b, e.data_bytes(64) + 4 * i).to_bits(), POISON_SCALE.to_bits());
            }
        } else {
            assert!(y[5].is_nan() && y[40] == f32::NEG_INFINITY, "{}", c.name());
            assert!(y.iter().enumerate().all(|(i, v)| i == 5 || i == 40 || v.is_finite()));
        }
    }
    // bf16 and fp16 write the canonical NaN.
    let (b, _, _) = round_trip(&KvFormat::Bf16.k(), &x);
    assert_eq!(u16::from_le_bytes([b[10], b[11]]), 0x7FFF);
}

#[test]
fn a_single_outlier() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for d in [64, 256] {
        let mut x = gaussian_row(&mut rng, d, 0.02);
        x[d / 3] = 40.0;
        for c in all_codecs() {
            assert_within_bound(&c, &x, if c.rotate { 0.2 } else { 1.0 });
            // The outlier itself survives every codec but vq2 to within 25 %.
            let (_, y, _) = round_trip(&c, &x);
            if c.elem != ElemCodec::Vq2 && c.elem != ElemCodec::Int2G32 {
                assert!((y[d / 3] - 40.0).abs() < 10.0, "{}: outlier -> {}", c.name(), y[d / 3]);
            }
        }
    }
}

#[test]
fn random_rows_round_trip_within_bounds() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for trial in 0..60 {
        let d = [32, 64, 96, 128, 256][trial % 5];
        let sigma = [1e-3f32, 1.0, 37.0][trial % 3];
        let x = gaussian_row(&mut rng, d, sigma);
        for c in all_codecs() {
            assert_within_bound(&c, &x, 0.16);
        }
    }
}

#[test]
fn quantized_codecs_really_quantize() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let x = gaussian_row(&mut rng, 128, 1.0);
    for c in all_codecs() {
        let (_, y, _) = round_trip(&c, &x);
        let n_changed = x.iter().zip(&y).filter(|(a, b)| a != b).count();
        match c.elem {
            ElemCodec::F32 => assert_eq!(n_changed, 0),
            // Every code of fewer than 16 bits changes almost every random element.
            _ => assert!(n_changed > 100, "{}: only {n_changed} of 128 elements changed", c.name()),
        }
    }
}

#[test]
fn error_grows_as_bits_shrink() {
    // Mean relative squared error over random rows: 8-bit < 4-bit < 2-bit.
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let rows: Vec<Vec<f32>> = (0..40).map(|_| gaussian_row(&mut rng, 64, 1.0)).collect();
    let rel = |c: RowCodec| {
        let (mut e, mut n) = (0.0f64, 0.0f64);
        for x in &rows {
            let (_, y, _) = round_trip(&c, x);
            e += x.iter().zip(&y).map(|(&a, &b)| ((a - b) as f64).powi(2)).sum::<f64>();
            n += x.iter().map(|&a| (a as f64).powi(2)).sum::<f64>();
        }
        e / n
    };
    let [bf, i8e, f8, nv, i4, i2, v2] = [
        KvFormat::Bf16.k(),
        KvFormat::Int8.k(),
        KvFormat::Fp8.k(),
        KvFormat::Nvfp4.k(),
        KvFormat::K4v2.k(),
        KvFormat::K4v2.v(),
        KvFormat::Vq2.k(),
    ]
    .map(rel);
    assert!(bf < i8e && i8e < nv && f8 < nv && nv < i2 && i4 < i2 && v2 < i2, "{bf} {i8e} {f8} {nv} {i4} {i2} {v2}");
}

#[test]
fn sum_sq_lanes_is_the_warp_order() {
    let v: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 * 1e-3).collect();
    let mut p = [0.0f32; 32];
    for l in 0..32 {
        p[l] = v[l] * v[l] + v[l + 32] * v[l + 32];
    }
    for off in [16, 8, 4, 2, 1] {
        for l in 0..off {
            p[l] += p[l + off];
        }
    }
    assert_eq!(sum_sq_lanes(&v).to_bits(), p[0].to_bits());
}

#[test]
fn kv_rotation_forces_scaled_codecs_only() {
    for r in KvRotation::ALL {
        assert_eq!(r.name().parse::<KvRotation>().unwrap(), r);
    }
    assert_eq!(KvRotation::default(), KvRotation::Auto);
    let err = "yes".parse::<KvRotation>().unwrap_err().to_string();
    assert!(err.contains("'yes'") && err.contains("auto, on, off"), "{err}");
    for f in KvFormat::ALL {
        // auto is the table.
        assert_eq!((f.k_with(KvRotation::Auto), f.v_with(KvRotation::Auto)), (f.k(), f.v()), "{f}");
        assert_eq!(KvCodecs::from(f), f.codecs(KvRotation::Auto));
        for (r, want) in [(KvRotation::On, true), (KvRotation::Off, false)] {
            let c = f.codecs(r);
            assert_eq!(c.format, f);
            for (got, table) in [(c.k, f.k()), (c.v, f.v())] {
                // The element code and so the row layout never change; only scaled codes rotate.
                assert_eq!(got.elem, table.elem, "{f} {r}");
                assert_eq!(got.row_bytes(256), table.row_bytes(256), "{f} {r}");
                assert_eq!(got.rotate, want && table.elem.is_scaled(), "{f} {r}: {}", got.name());
            }
        }
    }
    // The names the report records say which rows are rotated.
    assert_eq!(KvFormat::Fp8.k_with(KvRotation::On).name(), "fp8-e4m3+hadamard");
    assert_eq!(KvFormat::Fp8.k_with(KvRotation::Off).name(), "fp8-e4m3");
    assert_eq!(KvFormat::K8v4.v_with(KvRotation::Off).name(), "int4-g32");
}

#[test]
fn every_quantized_format_round_trips_unrotated_and_rotated() {
    // The CPU path of every format under --kv-rotation on and off: rows within the
    // codec's bound, and the two rotations really code differently.
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for f in KvFormat::ALL.into_iter().filter(|f| f.is_quantized()) {
        for d in [64, 256] {
            let x = gaussian_row(&mut rng, d, 1.0);
            for pick in [KvFormat::k_with, KvFormat::v_with] {
                let (on, off) = (pick(f, KvRotation::On), pick(f, KvRotation::Off));
                assert_within_bound(&on, &x, 0.16);
                assert_within_bound(&off, &x, 0.16);
                let (bytes_on, _, _) = round_trip(&on, &x);
                let (bytes_off, _, _) = round_trip(&off, &x);
                assert_ne!(bytes_on, bytes_off, "{f} d {d}: rotation changes the stored row");
            }
        }
    }
}
