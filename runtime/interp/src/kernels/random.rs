//! Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
//! counter-based generator behind TensorFlow's and JAX's stateless random ops: 128 random bits
//! from a 128-bit counter and a 64-bit key, with no state, so that any element of a random
//! tensor is computed on its own, in any order, on any backend, to the same bits.

/// Philox's round multipliers and Weyl key increments.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox-4x32 with 10 rounds of `counter` under `key`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The key and the counter's upper half of a random op's stream: the run's `seed` mixed with
/// the op's `salt`, and the `step`.
pub fn stream(seed: i64, salt: u64, step: i64) -> ([u32; 2], [u32; 2]) {
    let key = (seed as u64) ^ salt;
    ([key as u32, (key >> 32) as u32], [step as u32, ((step as u64) >> 32) as u32])
}

/// Element `e` of a stream: word `e % 4` of block `e / 4`, as a uniform `f32` in [0, 1) (its
/// top 24 bits over 2^24, exact in an f32).
pub fn uniform_at(key: [u32; 2], upper: [u32; 2], e: u64) -> f32 {
    let block = e / 4;
    let bits = philox4x32_10([block as u32, (block >> 32) as u32, upper[0], upper[1]], key);
    unit(bits[(e % 4) as usize])
}

/// The top 24 bits of `word` over 2^24: a uniform `f32` in [0, 1), exact.
fn unit(word: u32) -> f32 {
    (word >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// Element `e` of a stream, standard normal: Box-Muller, `sqrt(-2 ln u1) · cos(2π u2 − π)` (the
/// angle in [−π, π), where a GPU's `cos.approx` is accurate), on words
/// `2(e % 2)` and `2(e % 2) + 1` of block `e / 2` (`u1 = 1 - unit(first)`, in (0, 1], so that
/// the logarithm is finite), in f32 as the fused kernels compute it.
pub fn normal_at(key: [u32; 2], upper: [u32; 2], e: u64) -> f32 {
    let block = e / 2;
    let bits = philox4x32_10([block as u32, (block >> 32) as u32, upper[0], upper[1]], key);
    let pair = 2 * (e % 2) as usize;
    let u1 = 1.0 - unit(bits[pair]);
    let u2 = unit(bits[pair + 1]);
    let angle = u2 * std::f32::consts::TAU - std::f32::consts::PI;
    (-2.0 * u1.ln()).sqrt() * angle.cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors for philox4x32_10 (`kat_vectors`).
    #[test]
    fn philox_gives_the_known_answers() {
        assert_eq!(philox4x32_10([0, 0, 0, 0], [0, 0]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniforms_are_in_the_unit_interval_and_look_uniform() {
        let (key, upper) = stream(7, 0x1234, 3);
        let values: Vec<f32> = (0..100_000).map(|e| uniform_at(key, upper, e)).collect();
        assert!(values.iter().all(|v| (0.0..1.0).contains(v)));
        let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        let below = values.iter().filter(|&&v| v < 0.25).count() as f64 / values.len() as f64;
        assert!((below - 0.25).abs() < 0.005, "{below} below 0.25");
        // Another step, another stream.
        let (_, next) = stream(7, 0x1234, 4);
        assert_ne!(uniform_at(key, upper, 0), uniform_at(key, next, 0));
    }

    #[test]
    fn normals_have_mean_zero_and_deviation_one() {
        let (key, upper) = stream(11, 0x5678, 2);
        let values: Vec<f64> = (0..100_000).map(|e| f64::from(normal_at(key, upper, e))).collect();
        assert!(values.iter().all(|v| v.is_finite()));
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let variance = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((variance - 1.0).abs() < 0.015, "variance {variance}");
        // About 68.3% within one deviation, 95.4% within two.
        let within = |k: f64| values.iter().filter(|v| v.abs() < k).count() as f64 / n;
        assert!((within(1.0) - 0.6827).abs() < 0.006, "{} within 1", within(1.0));
        assert!((within(2.0) - 0.9545).abs() < 0.004, "{} within 2", within(2.0));
    }
}
