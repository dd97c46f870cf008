//! What a worker's ports hold for callers that have not proven the token.
//!
//! Until a caller has proven the token it costs the worker a socket and a tokio task, never a
//! thread, and only so many for so long:
//! - a connection that has not proven the token within [`UNPROVEN_DEADLINE`] is closed: on the
//!   gRPC port, one whose TLS handshake and first call with the token have not come by then; on
//!   the data port, one whose handshake has not ended;
//! - each port holds at most [`MAX_UNPROVEN`] such connections: one more closes the oldest of
//!   them, so that a flood cannot keep out a legitimate caller, whose proof takes a round trip
//!   or two, where refusing the newest would keep it out for as long as the flood lasts;
//! - the gRPC port holds at most [`MAX_CONNECTIONS`] connections in all; one more is closed at
//!   once (only callers holding the token can fill the room above the unproven ones).
//!
//! A connection that has proven the token is kept for as long as its peer keeps it (HTTP/2
//! keepalive pings close one whose peer has gone, see `crate::worker`).

use futures::task::AtomicWaker;
use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// How long a connection may take to prove the token.
pub const UNPROVEN_DEADLINE: Duration = Duration::from_secs(5);
/// The connections per port that have not proven the token yet, at most.
pub const MAX_UNPROVEN: usize = 256;
/// The connections to a worker's gRPC port, at most.
pub const MAX_CONNECTIONS: usize = 1024;

/// The connections of one port that have not proven the token yet, oldest first.
pub(crate) struct Unproven {
    cap: usize,
    waiting: Mutex<BTreeMap<u64, Arc<Gate>>>,
    next: AtomicU64,
}

/// One connection's state. `proven` and `evicted` change only under the registry's lock, so
/// that a connection is never both.
struct Gate {
    id: u64,
    proven: AtomicBool,
    evicted: AtomicBool,
    waker: AtomicWaker,
}

impl Unproven {
    pub(crate) fn new(cap: usize) -> Arc<Unproven> {
        Arc::new(Unproven { cap: cap.max(1), waiting: Mutex::new(BTreeMap::new()), next: AtomicU64::new(0) })
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Gate>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for a new connection; at the cap, the oldest waiting one is evicted.
    pub(crate) fn admit(self: &Arc<Self>) -> Admitted {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let gate = Arc::new(Gate {
            id,
            proven: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        let mut waiting = self.waiting();
        while waiting.len() >= self.cap {
            let Some((_, oldest)) = waiting.pop_first() else { break };
            oldest.evicted.store(true, Ordering::Release);
            oldest.waker.wake();
        }
        waiting.insert(id, gate.clone());
        Admitted { gate, unproven: self.clone() }
    }

    fn prove(&self, gate: &Gate) {
        let mut waiting = self.waiting();
        if !gate.evicted.load(Ordering::Acquire) {
            gate.proven.store(true, Ordering::Release);
            waiting.remove(&gate.id);
        }
    }

    /// How many connections wait to prove the token.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.waiting().len()
    }
}

/// A connection's place among the unproven ones, which it leaves when it proves the token or
/// is dropped.
pub(crate) struct Admitted {
    gate: Arc<Gate>,
    unproven: Arc<Unproven>,
}

impl Admitted {
    /// The connection has proven the token: no deadline, no eviction any more.
    pub(crate) fn prove(&self) {
        self.unproven.prove(&self.gate);
    }

    pub(crate) fn is_proven(&self) -> bool {
        self.gate.proven.load(Ordering::Acquire)
    }

    /// Ready once the connection has been evicted to make room for a newer one.
    fn poll_evicted(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.gate.evicted.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        self.gate.waker.register(cx.waker());
        // Evicted between the first look and the registration: the wake went to no one.
        if self.gate.evicted.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Ends when the connection is evicted (never, once it has proven the token).
    pub(crate) async fn evicted(&self) {
        std::future::poll_fn(|cx| self.poll_evicted(cx)).await
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.unproven.waiting().remove(&self.gate.id);
    }
}

/// Who is calling, as tonic hands it to the token's interceptor with each request (the
/// `ConnectInfo` of a [`Guarded`] connection): the interceptor marks the connection proven.
#[derive(Clone)]
pub struct Caller {
    pub remote: Option<SocketAddr>,
    gate: Arc<Gate>,
    unproven: Arc<Unproven>,
}

impl Caller {
    pub(crate) fn proven(&self) {
        self.unproven.prove(&self.gate);
    }
}

/// A gRPC connection held to the deadline and the cap until it proves the token.
pub struct Guarded {
    io: tokio::net::TcpStream,
    admitted: Admitted,
    /// `None` once the connection has proven the token.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl Guarded {
    /// An error once the connection must close: evicted, or past its deadline unproven.
    /// Registers the task for both, so that an idle connection is woken to be closed.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let Some(deadline) = &mut self.deadline else { return Ok(()) };
        if self.admitted.is_proven() {
            self.deadline = None;
            return Ok(());
        }
        if self.admitted.poll_evicted(cx).is_ready() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room: too many connections that have not proven the token",
            ));
        }
        if deadline.as_mut().poll(cx).is_ready() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no call with the token within {} s", UNPROVEN_DEADLINE.as_secs()),
            ));
        }
        Ok(())
    }
}

impl AsyncRead for Guarded {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = Caller;

    fn connect_info(&self) -> Caller {
        Caller {
            remote: self.io.peer_addr().ok(),
            gate: self.admitted.gate.clone(),
            unproven: self.admitted.unproven.clone(),
        }
    }
}

/// The connections `listener` accepts, each held to the deadline and the caps, with Nagle's
/// algorithm off (a step's small messages, a scalar loss, would otherwise wait for delayed
/// acknowledgements, 40 ms each). Never an error: tonic would end the server on one.
pub(crate) fn incoming(listener: tokio::net::TcpListener) -> impl futures::Stream<Item = io::Result<Guarded>> {
    let unproven = Unproven::new(MAX_UNPROVEN);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    futures::stream::unfold((listener, unproven, slots), |(listener, unproven, slots)| async move {
        loop {
            let Some(stream) = accept(&listener).await else { continue };
            // Full: the connection is dropped, that is closed.
            let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
            if stream.set_nodelay(true).is_err() {
                continue;
            }
            let deadline = Some(Box::pin(tokio::time::sleep(UNPROVEN_DEADLINE)));
            let guarded = Guarded { io: stream, admitted: unproven.admit(), deadline, _slot: slot };
            return Some((Ok(guarded), (listener, unproven, slots)));
        }
    })
}

/// The next connection on `listener`; `None` after a failed accept (out of file descriptors,
/// a connection reset before it was taken), after a pause rather than a spin.
pub(crate) async fn accept(listener: &tokio::net::TcpListener) -> Option<tokio::net::TcpStream> {
    match listener.accept().await {
        Ok((stream, _)) => Some(stream),
        Err(_) => {
            tokio::time::sleep(Duration::from_millis(20)).await;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_unproven_connection_makes_room_and_proven_ones_leave_the_count() {
        let unproven = Unproven::new(3);
        let first = unproven.admit();
        let second = unproven.admit();
        second.prove();
        let third = unproven.admit();
        let fourth = unproven.admit();
        assert_eq!(unproven.len(), 3, "the proven one does not count");
        assert!(!first.gate.evicted.load(Ordering::Acquire));
        let fifth = unproven.admit();
        assert!(first.gate.evicted.load(Ordering::Acquire), "the oldest unproven one went");
        assert!(!second.gate.evicted.load(Ordering::Acquire), "a proven one is never evicted");
        first.prove();
        assert!(!first.is_proven(), "an evicted connection stays evicted");
        drop((third, fourth, fifth));
        assert_eq!(unproven.len(), 0, "dropped connections leave");
    }
}
