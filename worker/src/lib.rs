//! The worker: runs execution jobs in capped Docker sandboxes — one-off jobs in a kernel of
//! their own, session jobs in the long-lived kernel of the session this worker holds — then
//! commits each result and its artifacts.
//!
//! The data path through this crate: [`consumer`] (the shared and the worker's own queue) →
//! [`run`] (`run::job`, the one function every job goes through: [`inputs`] — uploads fetched
//! within the job's workspace and the worker's fetch budget —, claim, a kernel under a slot,
//! the cell, commit), with the kernel's [`run::Host`]: a one-off kernel, or
//! [`session`] (one task per held session, found through [`registry`]) → [`kernel`] (cells under a wall clock, interrupts)
//! → [`outcome`] (driver events into an outcome, then the result's `Execution` document; what
//! each event adds is also published live by [`events`]) →
//! [`sandbox`] (container limits, driver framing) → [`artifacts`] (object store).
//! [`moving`] saves a session's variables when this worker drains and puts a moved session's
//! workspace and variables back when this worker takes it over.
//! [`pool`] keeps started kernels ready for the next session or one-off job; [`bound`] keeps a
//! one-off job's sandbox for its tenant's next one-off job (each runs in a process forked for it).
//! Around them: [`config`] (every setting, from the environment), [`context`] (what every
//! handler shares; slots as guards, and when a cell last ran: the lull background work waits for), [`ledger`] (the one place deliveries are acked), [`metrics`],
//! and [`service`] (start-up, health, heartbeat, shutdown: the wiring of the above).
#![warn(missing_docs)]

mod artifacts;
mod bound;
mod config;
mod consumer;
mod context;
mod events;
mod inputs;
mod kernel;
mod ledger;
mod metrics;
mod moving;
mod outcome;
mod pool;
mod registry;
mod run;
mod sandbox;
mod service;
mod session;

pub use config::{is_valid_worker_id, Config};
pub use service::{connect_docker, run};
