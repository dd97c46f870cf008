//! All-reduces through the MPI library of a job that `mpirun` (or `srun`, with an MPI built for
//! Slurm) launched, as Horovod runs them: a cluster's tuned collectives and fabric then serve
//! dfc's gradients. Every rank of the job is one dfc worker, MPI's rank its rank; `dfc run
//! --all-reduce mpi` initialises MPI in each ([`Job`]) and a registration asks for it.
//!
//! Built only with the `mpi` feature (the `mpi` crate, which needs an MPI library's development
//! files and libclang to build); without it [`Job::init`] says how to get it.
//!
//! MPI's collectives must come in the same order on every rank. A worker's all-reduces do when
//! it holds one replica of each group and nothing overlaps them: the replicas' partitions
//! reach their all-reduces in one order (the driver refuses plans where they would not), and
//! one thread runs them. So registration refuses a worker with several replicas of a group, and
//! `dfc run` refuses plans with `--overlap`; calls are serialised all the same. An MPI
//! all-reduce cannot be given up: a step that fails elsewhere leaves it waiting until the
//! driver's failure ends the job (mpirun then stops every rank).

use dfc_interp::Tensor;

/// MPI, initialised for this process until the value is dropped (then finalised).
pub struct Job {
    #[cfg(feature = "mpi")]
    _universe: mpi::environment::Universe,
}

/// What to do where dfc was built without MPI.
#[cfg(not(feature = "mpi"))]
const NOT_BUILT: &str = "this dfc was built without MPI: build it with `cargo build --release --features mpi` \
     (it needs an MPI library's development files, e.g. Debian's libopenmpi-dev, and libclang)";

impl Job {
    /// Initialises MPI (threads allowed to call it) for the launcher's rank `rank` of `size`
    /// workers: MPI's world must be the same.
    pub fn init(size: usize, rank: usize) -> Result<Job, String> {
        #[cfg(feature = "mpi")]
        {
            use mpi::traits::Communicator;
            let (universe, _threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
                .ok_or("MPI was initialised before in this process")?;
            let world = universe.world();
            let (world_size, world_rank) = (world.size() as usize, world.rank() as usize);
            if (world_size, world_rank) != (size, rank) {
                return Err(format!(
                    "MPI's world is rank {world_rank} of {world_size}, but this process is worker {rank} of {size}: \
                     start one rank per worker of the cluster (mpirun -n {size})"
                ));
            }
            Ok(Job { _universe: universe })
        }
        #[cfg(not(feature = "mpi"))]
        {
            let _ = (size, rank);
            Err(NOT_BUILT.into())
        }
    }
}

impl Job {
    /// Initialises MPI for a process of a job whatever its rank: this rank and the world's size.
    pub fn init_world() -> Result<(Job, usize, usize), String> {
        #[cfg(feature = "mpi")]
        {
            use mpi::traits::Communicator;
            let (universe, _threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
                .ok_or("MPI was initialised before in this process")?;
            let world = universe.world();
            let (rank, size) = (world.rank() as usize, world.size() as usize);
            Ok((Job { _universe: universe }, rank, size))
        }
        #[cfg(not(feature = "mpi"))]
        Err(NOT_BUILT.into())
    }
}

impl Job {
    /// Ends every process of the job (`MPI_Abort`), for a failure after which the other ranks
    /// could wait forever (in an all-reduce, or in MPI's finalisation).
    pub fn abort(self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        {
            use mpi::traits::Communicator;
            mpi::topology::SimpleCommunicator::world().abort(code)
        }
        #[cfg(not(feature = "mpi"))]
        std::process::exit(code)
    }
}

/// The longest text [`all_gather_text`] and [`broadcast_text`] carry.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
const MAX_TEXT: usize = 256;
/// A text in a fixed slot, as MPI's collectives move it: its length (2 bytes), its bytes.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
const SLOT: usize = MAX_TEXT + 2;

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn to_slot(value: &str) -> Result<[u8; SLOT], String> {
    let bytes = value.as_bytes();
    if bytes.len() > MAX_TEXT {
        return Err(format!("`{value}` is longer than {MAX_TEXT} bytes"));
    }
    let mut slot = [0u8; SLOT];
    slot[..2].copy_from_slice(&(bytes.len() as u16).to_le_bytes());
    slot[2..2 + bytes.len()].copy_from_slice(bytes);
    Ok(slot)
}

#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn from_slot(slot: &[u8]) -> Result<String, String> {
    let len = (u16::from_le_bytes([slot[0], slot[1]]) as usize).min(MAX_TEXT);
    String::from_utf8(slot[2..2 + len].to_vec()).map_err(|e| e.to_string())
}

/// Every rank's `value` (at most [`MAX_TEXT`] bytes), by rank.
pub fn all_gather_text(value: &str) -> Result<Vec<String>, String> {
    #[cfg(feature = "mpi")]
    {
        use mpi::collective::CommunicatorCollectives;
        use mpi::traits::Communicator;
        let world = mpi::topology::SimpleCommunicator::world();
        let mine = to_slot(value)?;
        let mut all = vec![0u8; SLOT * world.size() as usize];
        world.all_gather_into(&mine[..], &mut all[..]);
        all.chunks(SLOT).map(from_slot).collect()
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = value;
        Err(NOT_BUILT.into())
    }
}

/// Rank 0's `value` (at most [`MAX_TEXT`] bytes) on every rank.
pub fn broadcast_text(value: &str) -> Result<String, String> {
    #[cfg(feature = "mpi")]
    {
        use mpi::collective::Root;
        use mpi::traits::Communicator;
        let mut slot = to_slot(value)?;
        mpi::topology::SimpleCommunicator::world().process_at_rank(0).broadcast_into(&mut slot[..]);
        from_slot(&slot)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = value;
        Err(NOT_BUILT.into())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_text_survives_its_slot_and_a_long_one_is_refused() {
        for text in ["", "127.0.0.1:40511", &"x".repeat(super::MAX_TEXT)] {
            assert_eq!(super::from_slot(&super::to_slot(text).unwrap()).unwrap(), text);
        }
        assert!(super::to_slot(&"x".repeat(super::MAX_TEXT + 1)).unwrap_err().contains("longer than"));
    }
}

/// The MPI library's own name for itself, and this processor's name.
pub fn library() -> (String, String) {
    #[cfg(feature = "mpi")]
    {
        let version = mpi::environment::library_version().unwrap_or_default();
        let first_line = version.lines().next().unwrap_or("").trim().to_string();
        (first_line, mpi::environment::processor_name().unwrap_or_default())
    }
    #[cfg(not(feature = "mpi"))]
    (String::new(), String::new())
}

/// This process's rank and MPI's world size, while MPI is initialised (and not finalised).
pub fn world() -> Option<(usize, usize)> {
    #[cfg(feature = "mpi")]
    {
        use mpi::traits::Communicator;
        if !mpi::environment::is_initialized() || mpi::environment::is_finalized() {
            return None;
        }
        let world = mpi::topology::SimpleCommunicator::world();
        Some((world.rank() as usize, world.size() as usize))
    }
    #[cfg(not(feature = "mpi"))]
    None
}

/// Whether this dfc can all-reduce through MPI.
pub const BUILT: bool = cfg!(feature = "mpi");

/// Sums `value` over every rank of MPI's world, in place (`MPI_Allreduce`, `MPI_SUM`).
pub fn all_reduce(value: &mut Tensor) -> Result<(), String> {
    #[cfg(feature = "mpi")]
    {
        use dfc_interp::Data;
        use mpi::collective::{CommunicatorCollectives, SystemOperation};
        use mpi::datatype::Equivalence;
        use std::sync::Mutex;
        static CALLS: Mutex<()> = Mutex::new(());
        if world().is_none() {
            return Err("MPI is not initialised in this worker".into());
        }
        fn sum<T: Equivalence + Copy>(values: &mut [T]) {
            let world = mpi::topology::SimpleCommunicator::world();
            let sent = values.to_vec();
            world.all_reduce_into(&sent[..], values, SystemOperation::sum());
        }
        let _serialised = CALLS.lock().unwrap_or_else(|e| e.into_inner());
        match &mut value.data {
            Data::F32(values) => sum(values),
            Data::F64(values) => sum(values),
            Data::I32(values) => sum(values),
            Data::I64(values) => sum(values),
            Data::U8(_) | Data::Bool(_) => return Err(format!("an all-reduce of {}: not a number type", value.ty())),
        }
        Ok(())
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = value;
        Err(NOT_BUILT.into())
    }
}

/// Times `iterations` MPI all-reduces of `bytes` of f32 over MPI's world, after one untimed,
/// each between barriers, with every element checked (as the ring's benchmark does): per
/// iteration, the slowest rank's seconds (on rank 0; the others get their own).
pub fn bench_all_reduce(bytes: u64, iterations: u32) -> Result<Vec<f64>, String> {
    #[cfg(feature = "mpi")]
    {
        use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
        use mpi::traits::Communicator;
        let world = mpi::topology::SimpleCommunicator::world();
        let (rank, n) = (world.rank() as usize, world.size() as usize);
        let elements = bytes as usize / 4;
        // Element i of rank r is (r + 1)·(i mod 1021 + 1): the sum is exact in f32 and shows a
        // misplaced segment.
        let factor = |i: usize| (i % 1021 + 1) as f32;
        let mine: Vec<f32> = (0..elements).map(|i| (rank + 1) as f32 * factor(i)).collect();
        let total = (n * (n + 1) / 2) as f32;
        let mut sum = vec![0f32; elements];
        let mut seconds = Vec::new();
        for iteration in 0..=iterations {
            world.barrier();
            let started = std::time::Instant::now();
            world.all_reduce_into(&mine[..], &mut sum[..], SystemOperation::sum());
            let elapsed = started.elapsed().as_secs_f64();
            world.barrier();
            if let Some(i) = (0..elements).find(|&i| sum[i] != total * factor(i)) {
                return Err(format!(
                    "MPI's all-reduce summed wrong: element {i} is {}, not {}",
                    sum[i],
                    total * factor(i)
                ));
            }
            let mut slowest = 0f64;
            let root = world.process_at_rank(0);
            if rank == 0 {
                root.reduce_into_root(&elapsed, &mut slowest, SystemOperation::max());
            } else {
                root.reduce_into(&elapsed, SystemOperation::max());
                slowest = elapsed;
            }
            if iteration > 0 {
                seconds.push(slowest);
            }
        }
        Ok(seconds)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = (bytes, iterations);
        Err(NOT_BUILT.into())
    }
}
