//! Where the partitions of a plan meet: `Send`/`Recv` pairs and all-reduces exchange tensors
//! through a [`Rendezvous`], one per step (keys are unique within a step, so they need no step
//! number).
//!
//! [`InProcessRendezvous`] joins partitions that run on threads of one process. Every wait has
//! a safety timeout, so that a plan that can never complete (a `Recv` whose `Send` never runs,
//! an all-reduce that a replica never joins) is an error naming the key, never a hang; and
//! [`Rendezvous::abort`] wakes every waiter with an error when a partition fails.

use crate::kernels;
use crate::tensor::Tensor;
use crate::InterpError;
use dfc_ir::{BinaryOp, Op, TensorType};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How the partitions of one step exchange tensors. Implementations are shared by the threads
/// that run the partitions.
pub trait Rendezvous: Sync {
    /// Hands `value` over under `key`; never blocks. Each key is sent once per step.
    fn send(&self, key: &str, value: Tensor) -> Result<(), InterpError>;

    /// The tensor sent under `key`, waiting until it is sent.
    fn recv(&self, key: &str) -> Result<Tensor, InterpError>;

    /// [`Rendezvous::send`] of the value of type `ty` whose little-endian bytes are `bytes`. By
    /// default through a tensor copied from them; a rendezvous that can send the bytes as they
    /// are overrides it.
    fn send_bytes(&self, key: &str, ty: &TensorType, bytes: &[u8]) -> Result<(), InterpError> {
        let value = Tensor::from_le_bytes(ty, bytes)
            .ok_or_else(|| conflict(key, format!("{} bytes are not a value of {ty}", bytes.len())))?;
        self.send(key, value)
    }

    /// [`Rendezvous::recv`] as the type and little-endian bytes of the tensor. By default
    /// copied out of the tensor; a rendezvous that receives bytes overrides it, and may share
    /// them between the receives of one value.
    fn recv_bytes(&self, key: &str) -> Result<(TensorType, Arc<Vec<u8>>), InterpError> {
        let value = self.recv(key)?;
        Ok((value.ty(), Arc::new(value.to_le_bytes())))
    }

    /// Contributes `value` as replica `replica` of the `group_size` replicas that reduce under
    /// `key`, waits for the others, and returns the sum of all contributions taken in replica
    /// order `0 + 1 + ... + (n - 1)`, with the interpreter's own `add`: every replica gets the
    /// same, bit-identical tensor. The contributions must all have one type.
    fn all_reduce(&self, key: &str, group_size: u32, replica: u32, value: Tensor) -> Result<Tensor, InterpError>;

    /// [`Rendezvous::all_reduce`] of the value of type `ty` whose little-endian bytes are
    /// `bytes`, the sum written over them. By default through a tensor copied in and out
    /// ([`all_reduce_through_copies`]); a rendezvous that can reduce in the caller's memory
    /// overrides it, which spares a large gradient's two copies.
    fn all_reduce_in_place(
        &self,
        key: &str,
        group_size: u32,
        replica: u32,
        ty: &TensorType,
        bytes: &mut [u8],
    ) -> Result<(), InterpError> {
        all_reduce_through_copies(self, key, group_size, replica, ty, bytes)
    }

    /// Gives up the step: every waiter, now or later, gets `InterpError::Aborted` with
    /// `reason`. The first reason given is kept.
    fn abort(&self, reason: &str);
}

/// A rendezvous for partitions that run on threads of one process: a mutex and a condition
/// variable. Make one per step.
#[derive(Debug)]
pub struct InProcessRendezvous {
    state: Mutex<State>,
    changed: Condvar,
    timeout: Duration,
}

#[derive(Debug, Default)]
struct State {
    sent: HashMap<String, Tensor>,
    reductions: HashMap<String, Reduction>,
    aborted: Option<String>,
}

#[derive(Debug)]
struct Reduction {
    group_size: u32,
    contributions: Vec<Option<Tensor>>,
    /// The sum, once every replica has contributed.
    sum: Option<Tensor>,
}

impl InProcessRendezvous {
    /// How long a `recv` or `all_reduce` waits before it reports a timeout: far longer than any
    /// step of a working plan should wait for another partition.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    pub fn new() -> InProcessRendezvous {
        InProcessRendezvous::with_timeout(InProcessRendezvous::DEFAULT_TIMEOUT)
    }

    /// A rendezvous whose waits give up after `timeout`.
    pub fn with_timeout(timeout: Duration) -> InProcessRendezvous {
        InProcessRendezvous { state: Mutex::new(State::default()), changed: Condvar::new(), timeout }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A thread that panicked while holding the lock left the state consistent (every
        // update is a single insert), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits until `ready` gives a value, the rendezvous is aborted, or the timeout passes.
    fn wait_for<T>(
        &self,
        key: &str,
        state: MutexGuard<'_, State>,
        ready: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T, InterpError> {
        wait_on(&self.changed, state, key, self.timeout, |state| state.aborted.clone(), ready)
    }
}

/// The wait of a rendezvous (this one, or a distributed one): on `changed`, until `ready` gives
/// a value (`Ok`), `aborted` gives a reason (`InterpError::Aborted`), or `timeout` passes
/// (`InterpError::RendezvousTimeout` naming `key`).
pub fn wait_on<S, T>(
    changed: &Condvar,
    mut state: MutexGuard<'_, S>,
    key: &str,
    timeout: Duration,
    aborted: impl Fn(&S) -> Option<String>,
    mut ready: impl FnMut(&mut S) -> Option<T>,
) -> Result<T, InterpError> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(reason) = aborted(&state) {
            return Err(InterpError::Aborted { reason });
        }
        if let Some(value) = ready(&mut state) {
            return Ok(value);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(InterpError::RendezvousTimeout { key: key.to_string(), after: timeout });
        }
        state = changed.wait_timeout(state, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
    }
}

impl Default for InProcessRendezvous {
    fn default() -> InProcessRendezvous {
        InProcessRendezvous::new()
    }
}

/// [`Rendezvous::all_reduce_in_place`] through [`Rendezvous::all_reduce`]: the bytes are copied
/// into a tensor, and its sum back over them.
pub fn all_reduce_through_copies<R: Rendezvous + ?Sized>(
    rendezvous: &R,
    key: &str,
    group_size: u32,
    replica: u32,
    ty: &TensorType,
    bytes: &mut [u8],
) -> Result<(), InterpError> {
    let value = Tensor::from_le_bytes(ty, bytes)
        .ok_or_else(|| conflict(key, format!("{} bytes are not a value of {ty}", bytes.len())))?;
    let sum = rendezvous.all_reduce(key, group_size, replica, value)?;
    if sum.ty() != *ty {
        return Err(conflict(key, format!("the sum is {}, the value reduced {ty}", sum.ty())));
    }
    bytes.copy_from_slice(&sum.to_le_bytes());
    Ok(())
}

fn conflict(key: &str, message: String) -> InterpError {
    InterpError::RendezvousConflict { key: key.to_string(), message }
}

impl Rendezvous for InProcessRendezvous {
    fn send(&self, key: &str, value: Tensor) -> Result<(), InterpError> {
        let mut state = self.lock();
        if let Some(reason) = &state.aborted {
            return Err(InterpError::Aborted { reason: reason.clone() });
        }
        if state.sent.contains_key(key) {
            return Err(conflict(key, "it was sent twice in one step".into()));
        }
        state.sent.insert(key.to_string(), value);
        drop(state);
        self.changed.notify_all();
        Ok(())
    }

    fn recv(&self, key: &str) -> Result<Tensor, InterpError> {
        let state = self.lock();
        // The value stays: a key may have more than one receiver.
        self.wait_for(key, state, |state| state.sent.get(key).cloned())
    }

    fn all_reduce(&self, key: &str, group_size: u32, replica: u32, value: Tensor) -> Result<Tensor, InterpError> {
        let mut state = self.lock();
        if let Some(reason) = &state.aborted {
            return Err(InterpError::Aborted { reason: reason.clone() });
        }
        if replica >= group_size {
            return Err(conflict(key, format!("replica {replica} of a group of {group_size}")));
        }
        let reduction = state.reductions.entry(key.to_string()).or_insert_with(|| Reduction {
            group_size,
            contributions: vec![None; group_size as usize],
            sum: None,
        });
        if reduction.group_size != group_size {
            return Err(conflict(
                key,
                format!("replicas disagree on the group size ({} and {group_size})", reduction.group_size),
            ));
        }
        if reduction.contributions[replica as usize].is_some() || reduction.sum.is_some() {
            return Err(conflict(key, format!("replica {replica} contributed twice")));
        }
        if let Some(other) = reduction.contributions.iter().flatten().next() {
            if other.ty() != value.ty() {
                return Err(conflict(key, format!("replicas contribute {} and {}", other.ty(), value.ty())));
            }
        }
        reduction.contributions[replica as usize] = Some(value);
        if reduction.contributions.iter().all(Option::is_some) {
            // The last to arrive sums, in replica order, and wakes the others.
            let mut parts = reduction.contributions.iter_mut().map(|c| c.take().expect("all present"));
            let mut sum = parts.next().expect("a group has at least one replica");
            for part in parts {
                sum = match kernels::compute(&Op::Binary(BinaryOp::Add), &[&sum, &part]) {
                    Ok(sum) => sum,
                    Err(fault) => return Err(fault.at(&format!("all-reduce `{key}`"))),
                };
            }
            reduction.sum = Some(sum);
            self.changed.notify_all();
        }
        self.wait_for(key, state, |state| state.reductions.get(key).and_then(|r| r.sum.clone()))
    }

    fn abort(&self, reason: &str) {
        let mut state = self.lock();
        if state.aborted.is_none() {
            state.aborted = Some(reason.to_string());
        }
        drop(state);
        self.changed.notify_all();
    }
}
