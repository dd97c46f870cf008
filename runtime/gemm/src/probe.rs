//! Temporary measurements.
#![allow(unused, clippy::all)]
use super::*;
use std::arch::x86_64::*;
#[cfg(test)]
#[repr(C)]
struct Timespec { s: i64, ns: i64 }
#[cfg(test)]
extern "C" { fn clock_gettime(id: i32, t: *mut Timespec) -> i32; }
/// Thread CPU time in seconds.
#[cfg(test)]
pub(crate) fn cpu() -> f64 {
    let mut t = Timespec { s: 0, ns: 0 };
    unsafe { clock_gettime(3, &mut t) };
    t.s as f64 + t.ns as f64 * 1e-9
}

#[cfg(test)]
mod probe {
    use super::*;
    #[test]
    #[ignore]
    fn kernel_peak() {
        for kc in [64usize, 128, 256, 384, 512] {
            let a = Buf::default();
            let mut a = a;
            let ap = a.ptr(12 * kc);
            let mut b = Buf::default();
            let bp = b.ptr(32 * kc * 8);
            let mut c = vec![0f32; 12 * 256];
            for jr_count in [1usize, 8] {
                let t = cpu();
                let reps = 20000 / jr_count;
                for _ in 0..reps {
                    for jr in 0..jr_count {
                        unsafe { kernel::<12, false>(kc, ap, 12, bp.add(jr * 32 * kc), c.as_mut_ptr().add(jr * 32), 256, 32, false, false) };
                    }
                }
                let s = cpu() - t;
                let fl = 2.0 * 12.0 * 32.0 * kc as f64 * (reps * jr_count) as f64;
                println!("kc {kc} panels {jr_count}: {:.1} GFLOP/s", fl / s / 1e9);
            }
        }
    }
}

#[cfg(test)]
mod probe2 {
    use super::*;
    #[target_feature(enable = "avx512f")]
    fn peak(iters: usize, x: __m512) -> __m512 {
        let mut acc = [x; 24];
        let y = _mm512_set1_ps(1.0000001);
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, y, x);
            }
        }
        let mut s = acc[0];
        for a in &acc[1..] {
            s = _mm512_add_ps(s, *a);
        }
        s
    }
    #[test]
    #[ignore]
    fn fma_peak() {
        for _ in 0..3 {
            let t = cpu();
            let iters = 2_000_000;
            let r = unsafe { peak(iters, _mm512_set1_ps(0.5)) };
            std::hint::black_box(r);
            let s = cpu() - t;
            println!("peak {:.1} GFLOP/s", 2.0 * 16.0 * 24.0 * iters as f64 / s / 1e9);
        }
    }
}

#[cfg(test)]
mod probe3 {
    use super::*;
    #[target_feature(enable = "avx512f")]
    unsafe fn k<const R: usize, const V: usize>(kc: usize, a: *const f32, b: *const f32, c: *mut f32) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        let step = |a: *const f32, b: *const f32, acc: &mut [[__m512; V]; R]| {
            let mut bv = [_mm512_setzero_ps(); V];
            for v in 0..V { bv[v] = _mm512_load_ps(b.add(16 * v)); }
            for i in 0..R {
                let ai = _mm512_set1_ps(*a.add(i));
                for v in 0..V { acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]); }
            }
        };
        let (mut a, mut b) = (a, b);
        for _ in 0..kc / 4 {
            for u in 0..4 { step(a.add(u * R), b.add(u * 16 * V), &mut acc); }
            a = a.add(4 * R);
            b = b.add(4 * 16 * V);
        }
        for i in 0..R { for v in 0..V { _mm512_storeu_ps(c.add(i * 256 + 16 * v), acc[i][v]); } }
    }
    fn run<const R: usize, const V: usize>() {
        let kc = 256;
        let mut a = Buf::default();
        let ap = a.ptr(R * kc);
        let mut b = Buf::default();
        let bp = b.ptr(16 * V * kc);
        let mut c = vec![0f32; 32 * 256];
        let reps = 40000;
        let t = cpu();
        for _ in 0..reps { unsafe { k::<R, V>(kc, ap, bp, c.as_mut_ptr()) }; }
        let s = cpu() - t;
        println!("{R}x{}: {:.1} GFLOP/s", 16 * V, 2.0 * (R * 16 * V * kc * reps) as f64 / s / 1e9);
    }
    #[test]
    #[ignore]
    fn shapes() {
        for _ in 0..3 {
            run::<12, 2>();
            run::<14, 2>();
            run::<8, 3>();
            run::<6, 4>();
            run::<7, 4>();
            run::<24, 1>();
        }
    }
}

#[cfg(test)]
mod probe4 {
    use super::*;
    use std::arch::asm;
    /// 12×32, embedded broadcasts (both FMAs of a row use the memory operand).
    #[target_feature(enable = "avx512f")]
    unsafe fn k_emb(kc: usize, a: *const f32, b: *const f32, c: *mut f32) {
        let mut acc = [_mm512_setzero_ps(); 24];
        unsafe {
            let [mut c0, mut c1, mut c2, mut c3, mut c4, mut c5, mut c6, mut c7, mut c8, mut c9, mut c10, mut c11, mut c12, mut c13, mut c14, mut c15, mut c16, mut c17, mut c18, mut c19, mut c20, mut c21, mut c22, mut c23] = acc;
            asm!(
                "2:",
                "vmovaps zmm30, [{b}]",
                "vmovaps zmm31, [{b} + 64]",
                "vfmadd231ps {c0}, zmm30, dword ptr [{a}]{{1to16}}",
                "vfmadd231ps {c1}, zmm31, dword ptr [{a}]{{1to16}}",
                "vfmadd231ps {c2}, zmm30, dword ptr [{a}+4]{{1to16}}",
                "vfmadd231ps {c3}, zmm31, dword ptr [{a}+4]{{1to16}}",
                "vfmadd231ps {c4}, zmm30, dword ptr [{a}+8]{{1to16}}",
                "vfmadd231ps {c5}, zmm31, dword ptr [{a}+8]{{1to16}}",
                "vfmadd231ps {c6}, zmm30, dword ptr [{a}+12]{{1to16}}",
                "vfmadd231ps {c7}, zmm31, dword ptr [{a}+12]{{1to16}}",
                "vfmadd231ps {c8}, zmm30, dword ptr [{a}+16]{{1to16}}",
                "vfmadd231ps {c9}, zmm31, dword ptr [{a}+16]{{1to16}}",
                "vfmadd231ps {c10}, zmm30, dword ptr [{a}+20]{{1to16}}",
                "vfmadd231ps {c11}, zmm31, dword ptr [{a}+20]{{1to16}}",
                "vfmadd231ps {c12}, zmm30, dword ptr [{a}+24]{{1to16}}",
                "vfmadd231ps {c13}, zmm31, dword ptr [{a}+24]{{1to16}}",
                "vfmadd231ps {c14}, zmm30, dword ptr [{a}+28]{{1to16}}",
                "vfmadd231ps {c15}, zmm31, dword ptr [{a}+28]{{1to16}}",
                "vfmadd231ps {c16}, zmm30, dword ptr [{a}+32]{{1to16}}",
                "vfmadd231ps {c17}, zmm31, dword ptr [{a}+32]{{1to16}}",
                "vfmadd231ps {c18}, zmm30, dword ptr [{a}+36]{{1to16}}",
                "vfmadd231ps {c19}, zmm31, dword ptr [{a}+36]{{1to16}}",
                "vfmadd231ps {c20}, zmm30, dword ptr [{a}+40]{{1to16}}",
                "vfmadd231ps {c21}, zmm31, dword ptr [{a}+40]{{1to16}}",
                "vfmadd231ps {c22}, zmm30, dword ptr [{a}+44]{{1to16}}",
                "vfmadd231ps {c23}, zmm31, dword ptr [{a}+44]{{1to16}}",
                "add {a}, 48",
                "add {b}, 128",
                "dec {k}",
                "jnz 2b",
                a = inout(reg) a => _, b = inout(reg) b => _, k = inout(reg) kc => _,
                c0 = inout(zmm_reg) c0, c1 = inout(zmm_reg) c1, c2 = inout(zmm_reg) c2, c3 = inout(zmm_reg) c3,
                c4 = inout(zmm_reg) c4, c5 = inout(zmm_reg) c5, c6 = inout(zmm_reg) c6, c7 = inout(zmm_reg) c7,
                c8 = inout(zmm_reg) c8, c9 = inout(zmm_reg) c9, c10 = inout(zmm_reg) c10, c11 = inout(zmm_reg) c11,
                c12 = inout(zmm_reg) c12, c13 = inout(zmm_reg) c13, c14 = inout(zmm_reg) c14, c15 = inout(zmm_reg) c15,
                c16 = inout(zmm_reg) c16, c17 = inout(zmm_reg) c17, c18 = inout(zmm_reg) c18, c19 = inout(zmm_reg) c19,
                c20 = inout(zmm_reg) c20, c21 = inout(zmm_reg) c21, c22 = inout(zmm_reg) c22, c23 = inout(zmm_reg) c23,
                out("zmm30") _, out("zmm31") _,
                options(nostack),
            );
            acc = [c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23];
            for i in 0..24 { _mm512_storeu_ps(c.add(i * 16), acc[i]); }
        }
    }
    #[test]
    #[ignore]
    fn emb() {
        let kc = 256;
        let mut a = Buf::default();
        let ap = a.ptr(12 * kc);
        let mut b = Buf::default();
        let bp = b.ptr(32 * kc);
        let mut c = vec![0f32; 32 * 256];
        for _ in 0..3 {
            let reps = 40000;
            let t = cpu();
            for _ in 0..reps { unsafe { k_emb(kc, ap, bp, c.as_mut_ptr()) }; }
            let s = cpu() - t;
            println!("emb 12x32: {:.1} GFLOP/s", 2.0 * (12 * 32 * kc * reps) as f64 / s / 1e9);
        }
    }
}

#[cfg(test)]
mod probe5 {
    use super::*;
    use std::arch::asm;
    macro_rules! fmas { () => { concat!(
        "vfmadd231ps zmm0, zmm30, zmm31\n", "vfmadd231ps zmm1, zmm30, zmm31\n", "vfmadd231ps zmm2, zmm30, zmm31\n",
        "vfmadd231ps zmm3, zmm30, zmm31\n", "vfmadd231ps zmm4, zmm30, zmm31\n", "vfmadd231ps zmm5, zmm30, zmm31\n",
        "vfmadd231ps zmm6, zmm30, zmm31\n", "vfmadd231ps zmm7, zmm30, zmm31\n", "vfmadd231ps zmm8, zmm30, zmm31\n",
        "vfmadd231ps zmm9, zmm30, zmm31\n", "vfmadd231ps zmm10, zmm30, zmm31\n", "vfmadd231ps zmm11, zmm30, zmm31\n",
        "vfmadd231ps zmm12, zmm30, zmm31\n", "vfmadd231ps zmm13, zmm30, zmm31\n", "vfmadd231ps zmm14, zmm30, zmm31\n",
        "vfmadd231ps zmm15, zmm30, zmm31\n", "vfmadd231ps zmm16, zmm30, zmm31\n", "vfmadd231ps zmm17, zmm30, zmm31\n",
        "vfmadd231ps zmm18, zmm30, zmm31\n", "vfmadd231ps zmm19, zmm30, zmm31\n", "vfmadd231ps zmm20, zmm30, zmm31\n",
        "vfmadd231ps zmm21, zmm30, zmm31\n", "vfmadd231ps zmm22, zmm30, zmm31\n", "vfmadd231ps zmm23, zmm30, zmm31\n",
    )}}
    #[target_feature(enable = "avx512f")]
    unsafe fn e(iters: usize, p: *const f32, variant: u32) {
        unsafe {
        match variant {
            0 => asm!("2:", fmas!(), "dec {k}", "jnz 2b", k = inout(reg) iters => _, out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm24") _, out("zmm25") _, out("zmm26") _),
            1 => asm!("2:", fmas!(),
                "vbroadcastss zmm24, [{p}]", "vbroadcastss zmm25, [{p}+4]", "vbroadcastss zmm26, [{p}+8]", "vbroadcastss zmm24, [{p}+12]",
                "vbroadcastss zmm25, [{p}+16]", "vbroadcastss zmm26, [{p}+20]", "vbroadcastss zmm24, [{p}+24]", "vbroadcastss zmm25, [{p}+28]",
                "vbroadcastss zmm26, [{p}+32]", "vbroadcastss zmm24, [{p}+36]", "vbroadcastss zmm25, [{p}+40]", "vbroadcastss zmm26, [{p}+44]",
                "vmovaps zmm27, [{p}+64]", "vmovaps zmm28, [{p}+128]",
                "dec {k}", "jnz 2b", k = inout(reg) iters => _, p = in(reg) p, out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _, out("zmm28") _),
            2 => asm!("2:", fmas!(),
                "vbroadcastss zmm24, [{p}]", "vbroadcastss zmm25, [{p}+4]", "vbroadcastss zmm26, [{p}+8]", "vbroadcastss zmm24, [{p}+12]",
                "vbroadcastss zmm25, [{p}+16]", "vbroadcastss zmm26, [{p}+20]", "vbroadcastss zmm24, [{p}+24]", "vbroadcastss zmm25, [{p}+28]",
                "vbroadcastss zmm26, [{p}+32]", "vbroadcastss zmm24, [{p}+36]", "vbroadcastss zmm25, [{p}+40]", "vbroadcastss zmm26, [{p}+44]",
                "dec {k}", "jnz 2b", k = inout(reg) iters => _, p = in(reg) p, out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm24") _, out("zmm25") _, out("zmm26") _),
            3 => asm!("2:", fmas!(),
                "vmovaps zmm27, [{p}+64]", "vmovaps zmm28, [{p}+128]", "vmovaps zmm27, [{p}+192]", "vmovaps zmm28, [{p}+256]",
                "vmovaps zmm27, [{p}+64]", "vmovaps zmm28, [{p}+128]", "vmovaps zmm27, [{p}+192]", "vmovaps zmm28, [{p}+256]",
                "dec {k}", "jnz 2b", k = inout(reg) iters => _, p = in(reg) p, out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm27") _, out("zmm28") _),
            _ => asm!("2:", fmas!(),
                "vbroadcastss zmm24, [{p}]", "vbroadcastss zmm25, [{p}+4]", "vbroadcastss zmm26, [{p}+8]", "vbroadcastss zmm24, [{p}+12]",
                "vbroadcastss zmm25, [{p}+16]", "vbroadcastss zmm26, [{p}+20]",
                "dec {k}", "jnz 2b", k = inout(reg) iters => _, p = in(reg) p, out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm24") _, out("zmm25") _, out("zmm26") _),
        }
        }
    }
    #[test]
    #[ignore]
    fn ports() {
        let mut b = Buf::default();
        let p = b.ptr(1024);
        for v in 0..5 {
            let iters = 1_000_000;
            let t = cpu();
            unsafe { e(iters, p, v) };
            let s = cpu() - t;
            println!("variant {v}: {:.1} GFLOP/s", 2.0 * (24 * 16 * iters) as f64 / s / 1e9);
        }
    }
}

#[cfg(test)]
mod probe6 {
    use super::*;
    pub const SHAPES: &[(usize, usize, usize, bool, bool)] = &[
        (128, 256, 784, false, false),
        (128, 256, 256, false, false),
        (128, 10, 256, false, false),
        (128, 256, 10, false, true),
        (256, 10, 128, true, false),
        (128, 256, 256, false, true),
        (256, 256, 128, true, false),
        (784, 256, 128, true, false),
        (43264, 32, 9, false, false),
        (7744, 64, 288, false, false),
        (288, 64, 7744, true, false),
        (7744, 288, 64, false, true),
        (64, 64, 1600, false, false),
        (100, 10, 784, false, false),
        (784, 10, 100, true, false),
    ];
    #[test]
    #[ignore]
    fn shapes_cpu() {
        let filter = std::env::var("PROBE").unwrap_or_default();
        let mut tot = 0.0; let mut totf = 0.0;
        for (idx, &(m, n, k, ta, tb)) in SHAPES.iter().enumerate() {
            if !filter.is_empty() && !filter.split(',').any(|f| f.parse::<usize>() == Ok(idx)) { continue; }
            let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32).collect();
            let b: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32).collect();
            let mut c = vec![0f32; m * n];
            let mut times = vec![];
            for _ in 0..400 {
                let t = cpu();
                crate::sgemm_strided(m, n, k, &a, if ta { m } else { k }, ta, &b, if tb { k } else { n }, tb, &mut c, n, false, false);
                times.push(cpu() - t);
            }
            times.sort_by(f64::total_cmp);
            let t = times[times.len() / 4];
            let fl = 2.0 * (m * n * k) as f64;
            if idx < 8 { tot += t; totf += fl; }
            println!("{m}x{n}x{k} ta={ta} tb={tb}: {:.1} us {:.1} GFLOP/s", t * 1e6, fl / t / 1e9);
        }
        if tot > 0.0 { println!("mlp: {:.1} us {:.1} GFLOP/s", tot * 1e6, totf / tot / 1e9); }
    }
}

#[cfg(test)]
mod probe8 {
    use super::*;
    #[inline(never)]
    #[target_feature(enable = "avx512f")]
    unsafe fn k_rows<const R: usize>(kc: usize, a: *const f32, lda: usize, b: *const f32, c: *mut f32) {
        let mut acc0 = [_mm512_setzero_ps(); R];
        let mut acc1 = [_mm512_setzero_ps(); R];
        unsafe {
            let step = |a: *const f32, b: *const f32, acc0: &mut [__m512; R], acc1: &mut [__m512; R]| {
                let b0 = _mm512_load_ps(b);
                let b1 = _mm512_load_ps(b.add(16));
                for i in 0..R {
                    let ai = _mm512_set1_ps(*a.add(i * lda));
                    acc0[i] = _mm512_fmadd_ps(ai, b0, acc0[i]);
                    acc1[i] = _mm512_fmadd_ps(ai, b1, acc1[i]);
                }
            };
            let (mut a, mut b) = (a, b);
            for _ in 0..kc / 4 {
                for u in 0..4 {
                    step(a.add(u), b.add(u * NR), &mut acc0, &mut acc1);
                }
                a = a.add(4);
                b = b.add(4 * NR);
            }
            for i in 0..R { _mm512_storeu_ps(c.add(i * 32), acc0[i]); _mm512_storeu_ps(c.add(i * 32 + 16), acc1[i]); }
        }
    }
    #[test]
    #[ignore]
    fn rows_kernel() {
        let kc = 384;
        for lda in [384usize, 784, 1024] {
            let a: Vec<f32> = vec![1.0; 12 * lda];
            let mut b = Buf::default();
            let bp = b.ptr(32 * kc * 8);
            let mut c = vec![0f32; 32 * 256];
            for _ in 0..2 {
                let reps = 5000;
                let t = cpu();
                for _ in 0..reps { for jr in 0..8 { unsafe { k_rows::<12>(kc, a.as_ptr(), lda, bp.add(jr * 32 * kc), c.as_mut_ptr()) }; } }
                let s = cpu() - t;
                println!("rows lda {lda}: {:.1} GFLOP/s", 2.0 * (12 * 32 * kc * reps * 8) as f64 / s / 1e9);
            }
        }
    }
}

#[cfg(test)]
mod dbg {
    #[test]
    fn dbg_case() {
        let (m, n, k) = (128usize, 256usize, 784usize);
        let mut rng = fastrand::Rng::with_seed(1);
        let a: Vec<f32> = (0..m * k).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let b: Vec<f32> = (0..n * k).map(|_| rng.f32() * 2.0 - 1.0).collect();
        for par in [true, false, true] {
            let mut c = vec![0f32; m * n];
            if std::env::var("CRATE").is_ok() { crate::sgemm(m, n, k, &a, false, &b, false, &mut c, false, par) } else { crate::sgemm_strided(m, n, k, &a, k, false, &b, n, false, &mut c, n, false, par) };
            let mut bad = vec![];
            for i in 0..m { for j in 0..n {
                let mut s = 0f32; for p in 0..k { s += a[i * k + p] * b[p * n + j]; }
                if (s - c[i * n + j]).abs() > 1e-2 { bad.push((i, j)); }
            }}
            println!("par {par}: {} bad, first {:?}", bad.len(), &bad[..bad.len().min(10)]);
        }
    }
}
#[cfg(test)]
mod dbg2 {
    #[test]
    fn dbg_small() {
        for (m, n, k) in [(24usize, 32usize, 7usize), (24, 32, 3), (13, 32, 4), (13, 32, 1)] {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 3) as f32).collect();
            let b: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32).collect();
            let mut c = vec![0f32; m * n];
            crate::sgemm_strided(m, n, k, &a, k, false, &b, n, false, &mut c, n, false, false);
            let col0: Vec<f32> = (0..m).map(|i| c[i * n]).collect();
            let want: Vec<f32> = (0..m).map(|i| (0..k).map(|p| a[i * k + p] * b[p * n]).sum()).collect();
            println!("{m}x{n}x{k}: got {col0:?}\n want {want:?}");
        }
    }
}
#[cfg(test)]
mod dbg3 {
    #[test]
    fn dbg_find() {
        let mut rng = fastrand::Rng::with_seed(1);
        'o: for k in [200usize, 300, 385, 500, 800] { for m in [1usize, 2, 6, 7, 12, 13] { for n in [16usize] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let b: Vec<f32> = (0..n * k).map(|_| rng.f32() * 2.0 - 1.0).collect();
            let mut c = vec![0f32; m * n];
            crate::sgemm_strided(m, n, k, &a, k, false, &b, n, false, &mut c, n, false, false);
            let mut bad = vec![];
            for i in 0..m { for j in 0..n {
                let mut s = 0f32; for p in 0..k { s += a[i * k + p] * b[p * n + j]; }
                if (s - c[i * n + j]).abs() > 1e-3 { bad.push((i, j)); }
            }}
            if !bad.is_empty() { println!("{m}x{n}x{k}: {} bad, first {:?}", bad.len(), &bad[..bad.len().min(10)]);  }
        }}}
    }
}
