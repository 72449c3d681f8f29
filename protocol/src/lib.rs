//! The public contract of sandcell.
//!
//! Everything a client publishes ([`Submission`]), everything the scheduler hands a worker
//! ([`ExecutionJob`]) and everything a client reads back ([`JobResult`]) is defined here, together
//! with the pure rules that judge them: validation of submissions, clamping of resource requests
//! to the operator's maximums, workspace path rules and the job status state machine.
//!
//! This crate does no I/O. Its types generate the JSON Schemas under `docs/schemas/`.
#![warn(missing_docs)]

pub mod cancel;
pub mod error;
pub mod event;
pub mod job;
pub mod limits;
pub mod notification;
pub mod paths;
pub mod result;
pub mod schema;
pub mod session;
pub mod status;
pub mod storable;
pub mod submission;
pub mod upload;

pub use error::{ErrorCode, Reason, MAX_REASON_MESSAGE_BYTES};
pub use event::{EventBody, JobEvent};
pub use job::ExecutionJob;
pub use limits::{ExecutionLimits, IntakeLimits, LimitPolicy, ResourceRequest};
pub use notification::JobNotification;
pub use result::{
    Artifact, ArtifactKind, ArtifactState, ExecError, Execution, FileEntry, FileListing, JobResult, LimitHit, Output, SkippedFile, Timings, Usage,
};
pub use session::{Adoption, JobSession, KeepAlivePolicy, MoveCause, Session, SessionMove, SessionState};
pub use status::JobStatus;
pub use submission::{parse_submission, InputFile, Language, Rejection, SessionRequest, Submission, MAX_OBJECT_KEY_BYTES};
