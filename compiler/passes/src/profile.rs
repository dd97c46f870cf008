//! A machine's measured costs (`dfc calibrate` writes them; `dfc compile --profile` reads
//! them), per number of threads: the time of the matrix products dfc runs by shape, what its
//! convolutions take beside a product of the same size, its fused kernels and copies by their
//! bytes, transcendental functions and row ops per element, a hand-off between threads, the
//! fixed cost of running a program; and the links between workers on one host (shared memory)
//! and between hosts (TCP), and a step driven on 1, 2 and 4 workers. The cost model
//! (`cost.rs`) predicts from these in place of FLOP counts at one assumed rate.
//!
//! A profile is JSON from outside: `Profile::from_json` refuses, with a message naming the
//! field, anything that is not a profile of this version with finite, positive times and a
//! table of the size it claims.

use serde::{Deserialize, Serialize};

/// The version of the profile's JSON form; a profile of another version is refused.
pub const PROFILE_VERSION: u32 = 3;

/// The largest profile file read (a profile is a few tens of kilobytes).
pub const MAX_PROFILE_BYTES: u64 = 4 << 20;

/// At most this many sizes per axis of the product table (it holds their cube, three times).
const MAX_SIZES: usize = 16;

/// At most this many runs (numbers of threads).
const MAX_RUNS: usize = 64;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub version: u32,
    /// The CPU it was measured on.
    pub cpu: Cpu,
    /// When, in seconds since 1970 (UTC).
    pub measured_at_unix: u64,
    /// The dfc that measured it (its version).
    pub dfc: String,
    /// The sizes along each of `m`, `n` and `k` at which products were timed: ascending, each
    /// at least 1.
    pub gemm_sizes: Vec<u32>,
    /// What a process computing on so many threads measured: one thread, and all of them.
    pub runs: Vec<Run>,
    /// Between two worker processes on one host (the shared-memory queues).
    pub shared_memory: Throughput,
    /// Rings of more worker processes of one host than two, by their number (ascending): on a
    /// host of few cores their members take turns on the cores, and each step of the ring
    /// waits for the next member to run.
    pub shared_memory_rings: Vec<Ring>,
    /// Between worker processes through the data plane's TCP connections (between hosts).
    pub tcp: Throughput,
    /// What a step driven on worker processes costs beyond their programs: the driver's calls,
    /// and the bytes of their feeds and fetches.
    pub driven_step: DrivenStep,
}

/// A step driven on worker processes of this host, beyond their programs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrivenStep {
    /// Its fixed cost by the number of workers the driver calls at once, `[workers, seconds]`
    /// (a `Curve`: beyond the most workers measured, growing with their number). On a host
    /// of few cores the calls, the workers' RPC threads and the driver share them, so that
    /// each worker costs more than the one before.
    pub latency: Curve,
    /// What each worker's feeds and fetches cost by their bytes.
    pub bytes_per_second: f64,
    /// Its fixed cost where each worker computes, for longer and longer (ascending by
    /// `computing_seconds`): a busy worker's RPC threads, and the driver, wait for a core, a
    /// step waits for the last worker to start, and the workers' compute loses what the
    /// others take of the cores.
    pub busy: Vec<BusyStep>,
    /// What a step costs more where its workers wait for each other within it (a receive from
    /// another worker, an all-reduce), by the number of workers driven (from 2), beyond busy
    /// workers that do not exchange and the link's own time: each worker reaches the exchange
    /// when its call arrived and its threads got a core, so that the step takes the latest
    /// start and then the latest finish. Empty (a profile from before it was measured, or
    /// `dfc calibrate --no-workers`): nothing.
    #[serde(default)]
    pub exchanging: Curve,
}

/// A driven step's fixed cost where each worker computes for `computing_seconds` (on the
/// threads of one of 4 workers sharing the host: one on 2 cores), by the number of workers,
/// beyond their computing (and their turns where they outnumber the cores) and their bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BusyStep {
    pub computing_seconds: f64,
    pub latency: Curve,
}

impl DrivenStep {
    /// A step on `workers` workers, one of which is fed and fetches `bytes` and computes for
    /// `computing` seconds: the fixed cost of idle workers at no computing, of busy ones at
    /// theirs, linear between them and beyond the longest (a worker's cores are shared for as
    /// long as it computes), never falling.
    pub fn seconds(&self, workers: usize, bytes: f64, computing: f64) -> f64 {
        let workers = workers.max(1) as f64;
        let mut points = vec![(0.0, self.latency.seconds(workers))];
        for busy in &self.busy {
            let floor = points.last().map_or(0.0, |p| p.1);
            points.push((busy.computing_seconds, busy.latency.seconds(workers).max(floor)));
        }
        let computing = computing.max(0.0);
        let at = points.iter().rposition(|p| p.0 <= computing).unwrap_or(0).min(points.len().saturating_sub(2));
        let (x0, y0) = points[at];
        let fixed = match points.get(at + 1) {
            Some(&(x1, y1)) => y0 + (y1 - y0) * (computing - x0) / (x1 - x0),
            None => y0,
        };
        fixed + bytes.max(0.0) / self.bytes_per_second
    }

    /// What a step of `workers` that exchange within it costs more than one whose workers do
    /// not (nothing on one worker).
    pub fn exchanging_seconds(&self, workers: usize) -> f64 {
        if workers < 2 {
            0.0
        } else {
            self.exchanging.seconds(workers as f64)
        }
    }

    fn check(&self) -> Result<(), String> {
        self.latency.check().map_err(|e| format!("latency.{e}"))?;
        if !positive(self.bytes_per_second) {
            return Err(format!("bytes_per_second: {}; it must be finite and positive", self.bytes_per_second));
        }
        if self.busy.len() > MAX_RUNS {
            return Err(format!("busy: at most {MAX_RUNS}, found {}", self.busy.len()));
        }
        let mut last = 0.0;
        for (i, busy) in self.busy.iter().enumerate() {
            if !positive(busy.computing_seconds) || busy.computing_seconds <= last {
                return Err(format!(
                    "busy[{i}].computing_seconds: {}; they must be finite, positive and ascending",
                    busy.computing_seconds
                ));
            }
            last = busy.computing_seconds;
            busy.latency.check().map_err(|e| format!("busy[{i}].latency.{e}"))?;
        }
        if !self.exchanging.points.is_empty() {
            self.exchanging.check().map_err(|e| format!("exchanging.{e}"))?;
        }
        Ok(())
    }
}

/// The costs measured on one number of threads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Run {
    pub threads: u32,
    /// The median time of `C = A·B` (dfc-gemm) for every `m`, `n` and `k` of `gemm_sizes`,
    /// `m` slowest.
    pub nn: Vec<f64>,
    /// `Aᵀ·B` (a weight's gradient), likewise.
    pub tn: Vec<f64>,
    /// `A·Bᵀ` (an input's gradient), likewise.
    pub nt: Vec<f64>,
    /// A convolution's time over that of a product of its im2col shape (`m` = output pixels
    /// of the batch, `n` = filters, `k` = window taps × input channels), for each of its three
    /// forms, by `k` (a convolution over few input channels is far from its product's speed).
    pub conv: ConvFactors,
    /// A pooling's time by the bytes it reads and writes, for each of its four ops: their
    /// windows' compares and scattered adds cost more than a fused kernel's bytes.
    pub pool: PoolCosts,
    /// A fused loop kernel's time by the bytes it reads and writes.
    pub kernel: Curve,
    /// A copy's (a slice, a concatenation, a transpose; a transfer within a process) by the
    /// bytes it reads and writes, on one thread.
    pub copy: Curve,
    /// How long one thread takes to see what another of its process hands it (the in-process
    /// rendezvous between partitions of one process).
    pub handoff_seconds: f64,
    /// What a kernel spends on each element of a transcendental function (exp, log, tanh, ...)
    /// beyond its bytes, in seconds.
    pub transcendental_seconds: f64,
    /// What a row op (layer norm, its gradient, argmax: folds along each row of the last
    /// axis) spends beyond its bytes.
    pub row: RowCost,
    /// The same for a row op with an exponential per element (softmax, log-softmax, their
    /// cross entropy).
    pub exp_row: RowCost,
    /// What running a program costs beyond its steps (feeds, fetches, waking the threads).
    pub program_seconds: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cpu {
    /// `model name` of /proc/cpuinfo, or what the platform calls it.
    pub name: String,
    /// `vendor_id`, `cpu family` and `model`, where known.
    pub vendor: String,
    pub family: u32,
    pub model: u32,
    /// The vector features the kernels choose by (`avx2`, `fma`, `avx512f`, ...).
    pub features: Vec<String>,
    /// The threads the kernels ran on (the rayon pool, one per core).
    pub threads: u32,
}

/// A row op's cost per element, measured on rows of two lengths; between them it is
/// interpolated in log-length, and beyond them it is the nearer one's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowCost {
    pub short_length: u32,
    pub short_seconds: f64,
    pub long_length: u32,
    pub long_seconds: f64,
}

impl RowCost {
    /// The cost over `elements` in rows of `length`.
    pub fn seconds(&self, elements: f64, length: f64) -> f64 {
        if elements <= 0.0 || length <= 0.0 {
            return 0.0;
        }
        let (short, long) = (f64::from(self.short_length), f64::from(self.long_length));
        let along =
            if long > short { ((length.ln() - short.ln()) / (long.ln() - short.ln())).clamp(0.0, 1.0) } else { 0.0 };
        elements * (self.short_seconds + along * (self.long_seconds - self.short_seconds))
    }

    fn check(&self) -> Result<(), String> {
        if self.short_length == 0 || self.long_length < self.short_length {
            return Err("lengths: expected 1 ≤ short_length ≤ long_length".into());
        }
        not_negative("short_seconds", self.short_seconds)?;
        not_negative("long_seconds", self.long_seconds)
    }
}

/// Times measured at several sizes, `[bytes, seconds]` by ascending bytes: a size between two
/// is interpolated in log-log, a smaller one takes the first's time, and a larger one the
/// last's rate.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Curve {
    pub points: Vec<[f64; 2]>,
}

impl Curve {
    pub fn seconds(&self, bytes: f64) -> f64 {
        match place(&self.points, bytes) {
            None => 0.0,
            Some(Place::Before(first)) => first[1],
            Some(Place::After(last)) => last[1] * bytes / last[0],
            Some(Place::Between(lo, hi, along)) => (lo[1].ln() + along * (hi[1].ln() - lo[1].ln())).exp(),
        }
    }

    fn check(&self) -> Result<(), String> {
        check_points(&self.points)
    }
}

/// Where `x` falls among `points` (ascending by their first value): at or before the first,
/// at or after the last, or between two, at `along` of the way from one to the other in log-x.
enum Place {
    Before([f64; 2]),
    After([f64; 2]),
    Between([f64; 2], [f64; 2], f64),
}

fn place(points: &[[f64; 2]], x: f64) -> Option<Place> {
    let (first, last) = (*points.first()?, *points.last()?);
    if x <= first[0] {
        return Some(Place::Before(first));
    }
    if x >= last[0] {
        return Some(Place::After(last));
    }
    let upper = points.iter().position(|p| p[0] >= x).unwrap_or(points.len() - 1);
    let (lo, hi) = (points[upper - 1], points[upper]);
    Some(Place::Between(lo, hi, (x.ln() - lo[0].ln()) / (hi[0].ln() - lo[0].ln())))
}

/// 1 to `MAX_SIZES` points of finite, positive values, ascending by the first.
fn check_points(points: &[[f64; 2]]) -> Result<(), String> {
    if points.is_empty() || points.len() > MAX_SIZES {
        return Err(format!("points: expected 1 to {MAX_SIZES} points, found {}", points.len()));
    }
    if points.iter().any(|p| !positive(p[0]) || !positive(p[1])) {
        return Err("points: sizes and times must be finite and positive".into());
    }
    if points.windows(2).any(|w| w[0][0] >= w[1][0]) {
        return Err("points: expected ascending sizes".into());
    }
    Ok(())
}

/// A fixed cost and a rate: `seconds = latency_seconds + bytes / bytes_per_second`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Throughput {
    pub latency_seconds: f64,
    pub bytes_per_second: f64,
}

/// An all-reduce's ring of `members` workers of one host: each of its `2(members − 1)` steps
/// costs the link's fixed cost, and its `2(members − 1)/members` of the tensor's bytes the link's
/// rate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ring {
    pub members: u32,
    pub link: Throughput,
}

impl Profile {
    /// The link of a ring of `members` workers of one host: measured at the most members that
    /// are not more (two: `shared_memory`).
    pub fn host_ring(&self, members: u32) -> Throughput {
        self.shared_memory_rings.iter().rev().find(|r| r.members <= members).map_or(self.shared_memory, |r| r.link)
    }
}

impl Throughput {
    pub fn seconds(&self, bytes: f64) -> f64 {
        self.latency_seconds + bytes.max(0.0) / self.bytes_per_second
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvFactors {
    pub forward: Factors,
    pub backprop_input: Factors,
    pub backprop_filter: Factors,
}

/// A factor measured at several lengths, `[length, factor]` by ascending length: between two
/// it is interpolated in log-length, and beyond them it is the nearer one's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Factors {
    pub points: Vec<[f64; 2]>,
}

impl Factors {
    /// The same factor at every length.
    pub fn constant(factor: f64) -> Factors {
        Factors { points: vec![[1.0, factor]] }
    }

    pub fn at(&self, length: f64) -> f64 {
        match place(&self.points, length) {
            None => 1.0,
            Some(Place::Before(end) | Place::After(end)) => end[1],
            Some(Place::Between(lo, hi, along)) => lo[1] + along * (hi[1] - lo[1]),
        }
    }

    fn check(&self) -> Result<(), String> {
        check_points(&self.points)
    }
}

/// Each pooling op's time by the bytes it reads and writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolCosts {
    pub max: Curve,
    pub max_grad: Curve,
    pub avg: Curve,
    pub avg_grad: Curve,
}

impl PoolCosts {
    fn check(&self) -> Result<(), String> {
        for (name, curve) in
            [("max", &self.max), ("max_grad", &self.max_grad), ("avg", &self.avg), ("avg_grad", &self.avg_grad)]
        {
            curve.check().map_err(|e| format!("{name}.{e}"))?;
        }
        Ok(())
    }
}

/// Which of a convolution's three products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvForm {
    Forward,
    BackpropInput,
    BackpropFilter,
}

impl Profile {
    /// A profile from its JSON text, checked in full.
    pub fn from_json(text: &str) -> Result<Profile, String> {
        let profile: Profile = serde_json::from_str(text).map_err(|e| format!("not a dfc profile: {e}"))?;
        profile.check()?;
        Ok(profile)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a profile is plain data")
    }

    /// Every claim the cost model relies on; the first one broken, named.
    pub fn check(&self) -> Result<(), String> {
        if self.version != PROFILE_VERSION {
            return Err(format!(
                "the profile has version {}, but this dfc reads version {PROFILE_VERSION}; run `dfc calibrate` again",
                self.version
            ));
        }
        let sizes = &self.gemm_sizes;
        if sizes.is_empty() || sizes.len() > MAX_SIZES {
            return Err(format!("gemm_sizes: expected 1 to {MAX_SIZES} sizes, found {}", sizes.len()));
        }
        if sizes[0] == 0 || sizes.windows(2).any(|w| w[0] >= w[1]) {
            return Err("gemm_sizes: expected ascending sizes of at least 1".into());
        }
        if self.runs.is_empty() || self.runs.len() > MAX_RUNS {
            return Err(format!("runs: expected 1 to {MAX_RUNS} runs, found {}", self.runs.len()));
        }
        if self.runs[0].threads == 0 || self.runs.windows(2).any(|w| w[0].threads >= w[1].threads) {
            return Err("runs: expected runs on ascending numbers of threads, at least 1".into());
        }
        for (i, run) in self.runs.iter().enumerate() {
            run.check(sizes.len()).map_err(|e| format!("runs[{i}].{e}"))?;
        }
        for (name, link) in [("shared_memory", &self.shared_memory), ("tcp", &self.tcp)] {
            link.check().map_err(|e| format!("{name}.{e}"))?;
        }
        if self.shared_memory_rings.len() > MAX_RUNS {
            return Err(format!("shared_memory_rings: at most {MAX_RUNS}, found {}", self.shared_memory_rings.len()));
        }
        for (i, ring) in self.shared_memory_rings.iter().enumerate() {
            ring.link.check().map_err(|e| format!("shared_memory_rings[{i}].link.{e}"))?;
        }
        let members: Vec<u32> = self.shared_memory_rings.iter().map(|r| r.members).collect();
        if members.first().is_some_and(|&m| m < 3) || members.windows(2).any(|w| w[0] >= w[1]) {
            return Err("shared_memory_rings: expected ascending numbers of members, at least 3".into());
        }
        self.driven_step.check().map_err(|e| format!("driven_step.{e}"))?;
        if self.cpu.threads == 0 {
            return Err("cpu.threads: 0; a profile is measured on at least one thread".into());
        }
        Ok(())
    }

    /// One line for reports: `AMD EPYC (family 25, model 17), 2 threads, measured 2026-12-06`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({} family {}, model {}), {} thread{}, measured {}",
            self.cpu.name,
            self.cpu.vendor,
            self.cpu.family,
            self.cpu.model,
            self.cpu.threads,
            if self.cpu.threads == 1 { "" } else { "s" },
            date_of(self.measured_at_unix)
        )
    }

    /// The costs of a process computing on `threads` threads: the run on the most threads
    /// that are not more (or the fewest measured).
    pub fn rates(&self, threads: u32) -> Rates<'_> {
        let run = self.runs.iter().rev().find(|r| r.threads <= threads).unwrap_or(&self.runs[0]);
        Rates { sizes: &self.gemm_sizes, run }
    }

    /// The costs on all the threads measured.
    pub fn full(&self) -> Rates<'_> {
        self.rates(u32::MAX)
    }
}

impl Run {
    fn check(&self, sizes: usize) -> Result<(), String> {
        let cells = sizes.pow(3);
        for (name, table) in [("nn", &self.nn), ("tn", &self.tn), ("nt", &self.nt)] {
            if table.len() != cells {
                return Err(format!("{name}: expected {cells} times ({sizes}³), found {}", table.len()));
            }
            if let Some(bad) = table.iter().find(|t| !positive(**t)) {
                return Err(format!("{name}: a time of {bad} s; times must be finite and positive"));
            }
        }
        for (name, factors) in [
            ("conv.forward", &self.conv.forward),
            ("conv.backprop_input", &self.conv.backprop_input),
            ("conv.backprop_filter", &self.conv.backprop_filter),
        ] {
            factors.check().map_err(|e| format!("{name}.{e}"))?;
        }
        self.pool.check().map_err(|e| format!("pool.{e}"))?;
        self.kernel.check().map_err(|e| format!("kernel.{e}"))?;
        self.copy.check().map_err(|e| format!("copy.{e}"))?;
        self.row.check().map_err(|e| format!("row.{e}"))?;
        self.exp_row.check().map_err(|e| format!("exp_row.{e}"))?;
        not_negative("transcendental_seconds", self.transcendental_seconds)?;
        not_negative("handoff_seconds", self.handoff_seconds)?;
        not_negative("program_seconds", self.program_seconds)
    }
}

impl Throughput {
    fn check(&self) -> Result<(), String> {
        if !positive(self.bytes_per_second) {
            return Err(format!("bytes_per_second: {}; it must be finite and positive", self.bytes_per_second));
        }
        not_negative("latency_seconds", self.latency_seconds)
    }
}

/// A profile's costs on one number of threads.
#[derive(Clone, Copy, Debug)]
pub struct Rates<'a> {
    sizes: &'a [u32],
    pub run: &'a Run,
}

impl<'a> Rates<'a> {
    /// The costs of `run`, whose product tables were timed at `sizes` (as a profile's
    /// `gemm_sizes`, and as many of them cubed).
    pub fn new(sizes: &'a [u32], run: &'a Run) -> Rates<'a> {
        Rates { sizes, run }
    }
}

impl Rates<'_> {
    /// The predicted time of `batch` products `m×k · k×n` (`transpose_a`: A is stored k×m),
    /// from the table: log-time interpolated between the measured sizes in log-size, and
    /// beyond the largest size, proportional to the size. Both transposed is not a form dfc's
    /// gradients make; it is priced as `Aᵀ·B`.
    pub fn gemm_seconds(
        &self,
        m: usize,
        n: usize,
        k: usize,
        transpose_a: bool,
        transpose_b: bool,
        batch: usize,
    ) -> f64 {
        if m == 0 || n == 0 || k == 0 || batch == 0 {
            return 0.0;
        }
        let table = match (transpose_a, transpose_b) {
            (false, false) => &self.run.nn,
            (false, true) => &self.run.nt,
            (true, _) => &self.run.tn,
        };
        let sizes = self.sizes;
        let s = sizes.len();
        let (mi, mscale) = axis_position(sizes, m);
        let (ni, nscale) = axis_position(sizes, n);
        let (ki, kscale) = axis_position(sizes, k);
        // Trilinear interpolation of ln(t) over the corners around (m, n, k).
        let mut log_t = 0.0;
        for (dm, wm) in [(0, 1.0 - mi.1), (1, mi.1)] {
            for (dn, wn) in [(0, 1.0 - ni.1), (1, ni.1)] {
                for (dk, wk) in [(0, 1.0 - ki.1), (1, ki.1)] {
                    let w = wm * wn * wk;
                    if w == 0.0 {
                        continue;
                    }
                    let at = |i: usize, d: usize| (i + d).min(s - 1);
                    let cell = (at(mi.0, dm) * s + at(ni.0, dn)) * s + at(ki.0, dk);
                    log_t += w * table[cell].ln();
                }
            }
        }
        batch as f64 * log_t.exp() * mscale * nscale * kscale
    }

    /// A convolution priced as its im2col product times the form's measured factor.
    pub fn conv_seconds(&self, form: ConvForm, m: usize, n: usize, k: usize) -> f64 {
        let conv = &self.run.conv;
        let taps = k as f64;
        match form {
            ConvForm::Forward => self.gemm_seconds(m, n, k, false, false, 1) * conv.forward.at(taps),
            // dX = dY · Wᵀ: pixels × taps from pixels × filters.
            ConvForm::BackpropInput => self.gemm_seconds(m, k, n, false, true, 1) * conv.backprop_input.at(taps),
            // dW = Xᵀ · dY: taps × filters over the pixels.
            ConvForm::BackpropFilter => self.gemm_seconds(k, n, m, true, false, 1) * conv.backprop_filter.at(taps),
        }
    }
}

/// Where `x` falls among `sizes`: the lower index, the fraction of the way to the next in
/// log-size, and a factor for sizes beyond the largest (time proportional to size there).
fn axis_position(sizes: &[u32], x: usize) -> ((usize, f64), f64) {
    let last = sizes.len() - 1;
    let x = x as f64;
    if x <= sizes[0] as f64 {
        return ((0, 0.0), 1.0);
    }
    if x >= sizes[last] as f64 {
        return ((last, 0.0), x / sizes[last] as f64);
    }
    let upper = sizes.iter().position(|&s| s as f64 >= x).unwrap_or(last);
    let lower = upper - 1;
    let (lo, hi) = (sizes[lower] as f64, sizes[upper] as f64);
    ((lower, (x.ln() - lo.ln()) / (hi.ln() - lo.ln())), 1.0)
}

fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// `value`, named `name`, checked finite and not negative.
fn not_negative(name: &str, value: f64) -> Result<(), String> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(format!("{name}: {value}; it must be finite and not negative"))
    }
}

/// `2026-12-06` from seconds since 1970 (the civil calendar, UTC).
pub fn date_of(unix_seconds: u64) -> String {
    // Howard Hinnant's days-to-civil algorithm.
    let days = (unix_seconds / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A profile whose products run at `rate` FLOP/s at every size on each thread, for tests.
    pub(crate) fn uniform(rate: f64) -> Profile {
        let sizes = vec![1u32, 16, 256];
        let run = |threads: u32| {
            let mut nn = Vec::new();
            for &m in &sizes {
                for &n in &sizes {
                    for &k in &sizes {
                        nn.push(2.0 * m as f64 * n as f64 * k as f64 / (rate * threads as f64));
                    }
                }
            }
            Run {
                threads,
                tn: nn.clone(),
                nt: nn.clone(),
                nn,
                conv: ConvFactors {
                    forward: Factors::constant(1.0),
                    backprop_input: Factors::constant(1.0),
                    backprop_filter: Factors::constant(1.0),
                },
                pool: PoolCosts {
                    max: Curve { points: vec![[1e3, 1e-6], [1e7, 1e-3]] },
                    max_grad: Curve { points: vec![[1e3, 1e-6], [1e7, 1e-3]] },
                    avg: Curve { points: vec![[1e3, 1e-6], [1e7, 1e-3]] },
                    avg_grad: Curve { points: vec![[1e3, 1e-6], [1e7, 1e-3]] },
                },
                kernel: Curve { points: vec![[1e3, 1e-6], [1e7, 1e-3]] },
                copy: Curve { points: vec![[1e3, 1e-6], [1e7, 1e-3]] },
                handoff_seconds: 20e-6,
                transcendental_seconds: 1e-9,
                row: RowCost { short_length: 16, short_seconds: 1e-9, long_length: 256, long_seconds: 2e-9 },
                exp_row: RowCost { short_length: 16, short_seconds: 2e-9, long_length: 256, long_seconds: 4e-9 },
                program_seconds: 5e-6,
            }
        };
        Profile {
            version: PROFILE_VERSION,
            cpu: Cpu {
                name: "test CPU".into(),
                vendor: "none".into(),
                family: 0,
                model: 0,
                features: vec![],
                threads: 2,
            },
            measured_at_unix: 1_796_515_200,
            dfc: "test".into(),
            runs: vec![run(1), run(2)],
            gemm_sizes: sizes,
            shared_memory: Throughput { latency_seconds: 5e-6, bytes_per_second: 5e9 },
            shared_memory_rings: vec![],
            tcp: Throughput { latency_seconds: 20e-6, bytes_per_second: 2e9 },
            driven_step: DrivenStep {
                latency: Curve { points: vec![[1.0, 100e-6]] },
                bytes_per_second: 1e9,
                busy: vec![BusyStep { computing_seconds: 1e-3, latency: Curve { points: vec![[1.0, 300e-6]] } }],
                exchanging: Curve { points: vec![[2.0, 100e-6], [4.0, 300e-6]] },
            },
        }
    }

    #[test]
    fn products_between_and_beyond_the_measured_sizes_scale_with_their_work() {
        let profile = uniform(50e9);
        let p = profile.full();
        let exact = |m: usize, n: usize, k: usize| 2.0 * (m * n * k) as f64 / 100e9;
        for (m, n, k) in [(16, 16, 16), (64, 64, 64), (100, 7, 300), (1024, 256, 4096), (1, 1, 1)] {
            let t = p.gemm_seconds(m, n, k, false, false, 1);
            let rel = (t - exact(m, n, k)).abs() / exact(m, n, k);
            assert!(rel < 1e-9, "{m}×{n}×{k}: {t} against {}", exact(m, n, k));
        }
        assert_eq!(p.gemm_seconds(0, 5, 5, false, false, 1), 0.0);
        let batched = p.gemm_seconds(16, 16, 16, true, false, 3);
        assert!((batched - 3.0 * exact(16, 16, 16)).abs() < 1e-15);
        // One thread: the run measured on one.
        let alone = profile.rates(1).gemm_seconds(64, 64, 64, false, false, 1);
        assert!((alone / (2.0 * exact(64, 64, 64)) - 1.0).abs() < 1e-9);
        assert_eq!(profile.rates(7).run.threads, 2);
    }

    #[test]
    fn a_damaged_profile_is_refused_with_the_field_it_breaks() {
        let good = uniform(100e9);
        assert_eq!(Profile::from_json(&good.to_json()).as_ref(), Ok(&good));
        let mut short = good.clone();
        short.runs[1].nt.pop();
        assert!(short.check().unwrap_err().contains("runs[1].nt"));
        let mut nan = good.clone();
        nan.runs[0].nn[3] = f64::NAN;
        assert!(nan.check().unwrap_err().contains("runs[0].nn"));
        let mut no_runs = good.clone();
        no_runs.runs.clear();
        assert!(no_runs.check().unwrap_err().contains("runs"));
        let mut unsorted = good.clone();
        unsorted.gemm_sizes = vec![16, 1, 256];
        assert!(unsorted.check().unwrap_err().contains("ascending"));
        let mut slow = good.clone();
        slow.tcp.bytes_per_second = 0.0;
        assert!(slow.check().unwrap_err().contains("tcp.bytes_per_second"));
        let mut negative = good.clone();
        negative.runs[1].kernel.points[0][1] = -1.0;
        assert!(negative.check().unwrap_err().contains("runs[1].kernel.points"));
        let mut unsorted = good.clone();
        unsorted.runs[0].copy.points.reverse();
        assert!(unsorted.check().unwrap_err().contains("runs[0].copy.points: expected ascending"));
        let mut newer = good.clone();
        newer.version = PROFILE_VERSION + 1;
        assert!(newer.check().unwrap_err().contains(&format!("version {}", PROFILE_VERSION + 1)));
        let mut factor = good.clone();
        factor.runs[0].conv.backprop_filter.points = vec![[9.0, f64::INFINITY]];
        assert!(factor.check().unwrap_err().contains("runs[0].conv.backprop_filter.points"));
        let mut pool = good.clone();
        pool.runs[1].pool.max_grad.points.clear();
        assert!(pool.check().unwrap_err().contains("runs[1].pool.max_grad.points"));
        let mut pair = good.clone();
        pair.shared_memory_rings = vec![Ring { members: 2, link: good.shared_memory }];
        assert!(pair.check().unwrap_err().contains("shared_memory_rings: expected ascending numbers of members"));
        let mut driven = good.clone();
        driven.driven_step.latency.points = vec![[1.0, -1e-4]];
        assert!(driven.check().unwrap_err().contains("driven_step.latency.points"));
        let mut busy = good.clone();
        busy.driven_step.busy[0].computing_seconds = 0.0;
        assert!(busy.check().unwrap_err().contains("driven_step.busy[0].computing_seconds"));
        assert!(Profile::from_json("{\"version\": 1}").unwrap_err().starts_with("not a dfc profile"));
        assert!(Profile::from_json("[]").is_err());
        let mut extra = serde_json::to_value(&good).unwrap();
        extra["surprise"] = serde_json::json!(1);
        assert!(Profile::from_json(&extra.to_string()).unwrap_err().contains("surprise"));
    }

    #[test]
    fn curves_interpolate_in_log_log_and_keep_the_last_rate_beyond() {
        let curve = Curve { points: vec![[1e3, 1e-6], [1e5, 1e-5]] };
        assert_eq!(curve.seconds(10.0), 1e-6);
        assert!((curve.seconds(1e4) - 10f64.powf(-5.5)).abs() < 1e-12);
        assert!((curve.seconds(1e6) - 1e-4).abs() < 1e-15);
    }

    #[test]
    fn factors_interpolate_in_log_length_and_keep_the_nearer_end_beyond() {
        let factors = Factors { points: vec![[9.0, 2.0], [576.0, 0.5]] };
        assert_eq!(factors.at(1.0), 2.0);
        assert_eq!(factors.at(10_000.0), 0.5);
        // 72 is halfway from 9 to 576 in log-length.
        assert!((factors.at(72.0) - 1.25).abs() < 1e-12);
        assert_eq!(Factors::constant(1.5).at(300.0), 1.5);
    }

    #[test]
    fn a_ring_is_priced_by_the_link_measured_at_the_most_members_not_more() {
        let mut profile = uniform(50e9);
        let slow = |latency_seconds: f64| Throughput { latency_seconds, bytes_per_second: 1e9 };
        profile.shared_memory_rings =
            vec![Ring { members: 3, link: slow(1e-5) }, Ring { members: 4, link: slow(2e-5) }];
        assert_eq!(profile.host_ring(2), profile.shared_memory);
        assert_eq!(profile.host_ring(3), slow(1e-5));
        assert_eq!(profile.host_ring(8), slow(2e-5));
        assert!(profile.check().is_ok());
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(date_of(0), "1970-01-01");
        assert_eq!(date_of(951_782_400), "2000-02-29");
        assert_eq!(date_of(1_796_515_200), "2026-12-06");
    }
}
