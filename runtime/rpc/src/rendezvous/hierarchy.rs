//! The hierarchical all-reduce, for a group whose workers sit on several hosts, L on each (as
//! Horovod's hierarchical all-reduce and NCCL's trees cut the bytes between nodes), in three
//! rings ([`super::ring`], each pipelined by chunks in the tensor's own memory):
//!
//! 1. within each host, the ring's reduce-scatter alone: the worker at local index j then holds
//!    the host's sum of segment j + 1 (of L);
//! 2. between hosts, the workers at local index j of every host run the whole ring over that
//!    segment: L rings of 1/L of the tensor, side by side, each on links between hosts;
//! 3. within each host, the ring's all-gather alone, from those segments.
//!
//! Each host then sends 2(H − 1)/H of the tensor to the next host (H hosts), where a flat ring
//! over all H·L workers carries 2(H·L − 1)/(H·L) of it over each of its links between hosts:
//! on 2 hosts of 2 workers, S against 1.5·S each way; half of it as L grows.
//!
//! Every worker ends with the same bits: each ring gives all its members the same bits, and
//! each segment's host sums are made once.

use super::ring::{segment, Phases};
use super::NetRendezvous;
use dfc_interp::{InterpError, Tensor};
use dfc_ir::TensorType;
use std::collections::HashMap;

/// How the all-reduces of a run go between workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Algorithm {
    /// One ring over all the group's workers.
    #[default]
    Ring,
    /// Hierarchical where a group's workers are on several hosts with as many on each (the
    /// ring elsewhere).
    Hierarchical,
    /// Through the MPI library of the job's launcher, for groups of every worker (the ring
    /// elsewhere): `crate::mpi`.
    Mpi,
}

impl Algorithm {
    /// The registration's (and benchmark's) name of the algorithm: "" is the ring, as workers
    /// that came before the choice take it.
    pub fn wire_name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::Mpi => "mpi",
        }
    }

    pub fn from_wire_name(name: &str) -> Result<Algorithm, String> {
        match name {
            "" | "ring" => Ok(Algorithm::Ring),
            "hierarchical" => Ok(Algorithm::Hierarchical),
            "mpi" => Ok(Algorithm::Mpi),
            other => Err(format!("unknown all-reduce algorithm `{other}` (ring, hierarchical or mpi)")),
        }
    }
}

/// The host of each worker, as an index (in the order hosts first appear), from the workers'
/// addresses (`host:port`): workers whose addresses name the same host share it.
pub fn hosts_of(addresses: &[String]) -> Vec<usize> {
    let mut hosts: HashMap<&str, usize> = HashMap::new();
    addresses
        .iter()
        .map(|address| {
            let host = address.rsplit_once(':').map_or(address.as_str(), |(host, _)| host);
            let next = hosts.len();
            *hosts.entry(host).or_insert(next)
        })
        .collect()
}

/// The ranks among `ranks` grouped by host (hosts in order of their first rank, ranks
/// ascending), if the hierarchical all-reduce applies to them: at least two hosts, and the same
/// number of workers, at least two, on each.
pub fn host_groups(ranks: &[usize], host_of: &[usize]) -> Option<Vec<Vec<usize>>> {
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    for rank in sorted {
        let host = *host_of.get(rank)?;
        match groups.iter_mut().find(|(h, _)| *h == host) {
            Some((_, members)) => members.push(rank),
            None => groups.push((host, vec![rank])),
        }
    }
    let per_host = groups.first()?.1.len();
    let applies = groups.len() >= 2 && per_host >= 2 && groups.iter().all(|(_, m)| m.len() == per_host);
    applies.then(|| groups.into_iter().map(|(_, members)| members).collect())
}

impl NetRendezvous {
    /// The all-reduce `key` of `value`, this worker's sum, over `hosts` (the group's ranks by
    /// host, this worker among them), hierarchically (see the module's comment).
    pub(super) fn hierarchical(&self, key: &str, hosts: &[Vec<usize>], value: Tensor) -> Result<Tensor, InterpError> {
        self.in_place(key, value, |ty, add, bytes| self.hierarchical_bytes(key, hosts, ty, add, bytes))
    }

    fn hierarchical_bytes(
        &self,
        key: &str,
        hosts: &[Vec<usize>],
        ty: &TensorType,
        add: super::ring::AddInto,
        buffer: &mut [u8],
    ) -> Result<(), InterpError> {
        let rank = self.routes.rank;
        let (host, me) = hosts
            .iter()
            .enumerate()
            .find_map(|(h, members)| members.iter().position(|&r| r == rank).map(|j| (h, j)))
            .expect("a worker in its group");
        let local = &hosts[host];
        let per_host = local.len();
        // Each ring waits, in the end, for the worker before this one in it.
        let previous = |ranks: &[usize], at: usize| ranks[(at + ranks.len() - 1) % ranks.len()];

        let _waiting = self.waiting(key, true, Some(previous(local, me)));
        self.ring_phases(&format!("{key}@host-scatter"), local, ty, add, buffer, Phases::ReduceScatter)?;
        drop(_waiting);

        let held = segment(ty.shape.n_elements(), ty.dtype.size_in_bytes(), per_host, (me + 1) % per_host);
        let held_type = TensorType::new(ty.dtype, vec![held.len() / ty.dtype.size_in_bytes()]);
        let across: Vec<usize> = hosts.iter().map(|members| members[me]).collect();
        let _waiting = self.waiting(key, true, Some(previous(&across, host)));
        self.ring_phases(&format!("{key}@hosts"), &across, &held_type, add, &mut buffer[held], Phases::Both)?;
        drop(_waiting);

        let _waiting = self.waiting(key, true, Some(previous(local, me)));
        self.ring_phases(&format!("{key}@host-gather"), local, ty, add, buffer, Phases::AllGather)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_share_a_host_when_their_addresses_name_it() {
        let addresses: Vec<String> =
            ["10.0.0.1:7000", "10.0.0.1:7002", "10.0.0.2:7000", "[::1]:7000", "10.0.0.2:7002", "[::1]:7002"]
                .map(String::from)
                .into();
        assert_eq!(hosts_of(&addresses), vec![0, 0, 1, 2, 1, 2]);
    }

    #[test]
    fn the_hierarchy_needs_several_hosts_with_as_many_workers_on_each() {
        let host_of = [0, 0, 1, 1, 1, 2, 2];
        assert_eq!(host_groups(&[3, 0, 2, 1], &host_of), Some(vec![vec![0, 1], vec![2, 3]]));
        assert_eq!(host_groups(&[0, 1, 5, 6, 2, 3], &host_of), Some(vec![vec![0, 1], vec![2, 3], vec![5, 6]]));
        assert_eq!(host_groups(&[0, 1], &host_of), None, "one host");
        assert_eq!(host_groups(&[0, 2], &host_of), None, "one worker per host");
        assert_eq!(host_groups(&[0, 1, 2, 3, 4], &host_of), None, "two and three");
        assert_eq!(host_groups(&[0, 9], &host_of), None, "a rank with no address");
    }

    #[test]
    fn segments_cover_the_tensor_in_order() {
        for (len, n) in [(10, 3), (1, 2), (0, 2), (7, 7)] {
            let cuts: Vec<std::ops::Range<usize>> = (0..n).map(|i| segment(len, 4, n, i)).collect();
            assert_eq!(cuts[0].start, 0);
            assert_eq!(cuts[n - 1].end, len * 4);
            assert!(cuts.windows(2).all(|w| w[0].end == w[1].start));
        }
    }

    #[test]
    fn names_of_the_algorithms() {
        for algorithm in [Algorithm::Ring, Algorithm::Hierarchical, Algorithm::Mpi] {
            assert_eq!(Algorithm::from_wire_name(algorithm.wire_name()), Ok(algorithm));
        }
        assert_eq!(Algorithm::from_wire_name(""), Ok(Algorithm::Ring));
        assert!(Algorithm::from_wire_name("tree").unwrap_err().contains("tree"));
    }
}
