//! The sandbox: one capped Docker container running the in-container driver, and the
//! conversation with it: over a Unix socket of its own ([`channel`]) where the driver can
//! connect, else over the attach stream.
//!
//! A [`Sandbox`] owns its container. It is removed by [`Sandbox::destroy`], and — should the
//! worker drop it on an unexpected path — by its `Drop`, so no container outlives its job.
//! Containers carry the worker's label, so a worker that died is cleaned up by the next start's
//! sweep ([`remove_leftovers`]).

pub mod cgroup;
pub mod channel;
pub mod container;
pub mod driver;
pub mod frames;

use std::collections::HashMap;
use std::pin::Pin;

use anyhow::{anyhow, Context, Result};
use bollard::container::LogOutput;
use bollard::query_parameters::{AttachContainerOptions, InspectContainerOptions, KillContainerOptions, ListContainersOptions, RemoveContainerOptions};
use bollard::Docker;
use futures::{FutureExt, Stream, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

use self::channel::{ChannelRoot, Listening};
use self::container::{create_body, SandboxSpec, LABEL_WORKER};
use self::driver::DriverEvent;
use self::frames::FrameDecoder;

/// Most driver diagnostics (container stderr) kept for the log.
const MAX_DIAGNOSTICS: usize = 16 * 1024;

/// How a container ended, from Docker's point of view.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExitState {
    /// The kernel OOM-killed a process in it.
    pub oom_killed: bool,
    /// Exit code of the driver, if it exited.
    pub exit_code: Option<i64>,
}

/// Which way the driver's frames travel.
enum Link {
    /// Until the driver's first frame: it connects to the socket, or speaks on its stdout.
    Pending(Listening),
    /// The driver connected: frames go over the socket.
    Socket(OwnedReadHalf, OwnedWriteHalf),
    /// Frames go over the attach stream (no channel directory, or the driver could not connect).
    Attach,
    /// The driver closed its socket (it exited or died): its end is reported once the attach
    /// stream ends too, i.e. once the container has exited, so that how it ended (an OOM kill,
    /// an exit code) can be read from it, as when the driver spoke over the attach stream.
    Closed,
}

/// A running sandbox container with its attached streams.
pub struct Sandbox {
    docker: Docker,
    id: String,
    link: Link,
    /// The attach stream's output: the driver's stdout (its frames under [`Link::Attach`]) and
    /// stderr (its diagnostics, always).
    output: Pin<Box<dyn Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>>,
    input: Option<Pin<Box<dyn AsyncWrite + Send>>>,
    /// The attach stream ended while the driver still spoke on its socket.
    stdio_closed: bool,
    decoder: FrameDecoder,
    diagnostics: Vec<u8>,
    /// Removes the container if the sandbox is dropped without [`Sandbox::destroy`].
    guard: RemoveOnDrop,
}

/// The address of the egress proxy container `name` on `network`.
async fn proxy_address(docker: &Docker, name: &str, network: &str) -> Result<String> {
    let proxy = docker
        .inspect_container(name, None::<bollard::query_parameters::InspectContainerOptions>)
        .await
        .with_context(|| format!("finding the egress proxy {name} (deploy/local/egress.sh up)"))?;
    proxy
        .network_settings
        .and_then(|n| n.networks)
        .and_then(|mut n| n.remove(network))
        .and_then(|n| n.ip_address)
        .filter(|ip| !ip.is_empty())
        .ok_or_else(|| anyhow!("the egress proxy {name} is not on the network {network} (deploy/local/egress.sh up grants the tenant)"))
}

impl Sandbox {
    /// Create, attach and start a container. `max_frame` bounds a single driver frame;
    /// `channels`: where the driver's socket goes (`None`: the attach stream only).
    pub async fn start(docker: &Docker, spec: &SandboxSpec, max_frame: usize, channels: Option<&ChannelRoot>) -> Result<Sandbox> {
        let mut body = create_body(spec);
        let listening = match channels.map(ChannelRoot::listen).transpose() {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "no socket for this sandbox's driver; it speaks over the attach stream");
                None
            }
        };
        if let Some(l) = &listening {
            if let Some(hc) = body.host_config.as_mut() {
                hc.binds.get_or_insert_with(Vec::new).push(l.bind());
            }
            body.env.get_or_insert_with(Vec::new).push(format!("SANDCELL_CHANNEL={}", Listening::path_in_container()));
        }
        if let Some((name, network)) = spec.egress.as_ref().and_then(|e| Some((e.proxy_name()?, e.network.as_str()))) {
            let address = proxy_address(docker, name, network).await?;
            if let Some(hc) = body.host_config.as_mut() {
                hc.extra_hosts = Some(vec![format!("{name}:{address}")]);
            }
        }
        let created = docker
            .create_container(None::<bollard::query_parameters::CreateContainerOptions>, body)
            .await
            .with_context(|| format!("creating a sandbox from image {}", spec.image))?;
        let id = created.id;
        // From here on the container exists; make sure an error below does not leak it.
        let guard = RemoveOnDrop { docker: docker.clone(), id: Some(id.clone()) };
        let attach = docker
            .attach_container(&id, Some(AttachContainerOptions { stdin: true, stdout: true, stderr: true, stream: true, logs: false, detach_keys: None }))
            .await
            .context("attaching to the sandbox")?;
        docker.start_container(&id, None::<bollard::query_parameters::StartContainerOptions>).await.context("starting the sandbox")?;
        Ok(Sandbox {
            docker: docker.clone(),
            id,
            link: listening.map_or(Link::Attach, Link::Pending),
            output: attach.output,
            input: Some(attach.input),
            stdio_closed: false,
            decoder: FrameDecoder::new(max_frame),
            diagnostics: Vec::new(),
            guard,
        })
    }

    /// The container id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether the driver's frames travel over its own socket (not the attach stream).
    pub fn on_socket(&self) -> bool {
        matches!(self.link, Link::Socket(..))
    }

    /// Send one frame to the driver.
    pub async fn send(&mut self, payload: &[u8]) -> Result<()> {
        let frame = frames::encode(payload);
        if let Link::Socket(_, write) = &mut self.link {
            return write.write_all(&frame).await.context("writing to the sandbox's socket");
        }
        let input = self.input.as_mut().ok_or_else(|| anyhow!("sandbox input already closed"))?;
        input.write_all(&frame).await.context("writing to the sandbox")?;
        input.flush().await.context("flushing the sandbox input")?;
        Ok(())
    }

    /// The next driver event; `Ok(None)` when the driver's output ended (it exited or died).
    pub async fn next_event(&mut self) -> Result<Option<DriverEvent>> {
        let mut chunk = Vec::with_capacity(64 * 1024);
        loop {
            if let Some(frame) = self.decoder.next_frame()? {
                let event = serde_json::from_slice::<DriverEvent>(&frame).map_err(|e| frames::FrameError::Invalid(e.to_string()))?;
                return Ok(Some(event));
            }
            // The attach stream is read in every state: stderr must never fill up.
            let heard = match &mut self.link {
                Link::Attach | Link::Closed => Heard::Attach(self.output.next().await),
                Link::Pending(listening) => tokio::select! {
                    conn = listening.accept() => Heard::Connected(conn),
                    out = self.output.next() => Heard::Attach(out),
                },
                Link::Socket(read, _) => {
                    chunk.clear();
                    tokio::select! {
                        n = read.read_buf(&mut chunk) => Heard::Socket(n),
                        out = self.output.next() => Heard::Attach(out),
                    }
                }
            };
            match heard {
                Heard::Connected(Ok(stream)) => {
                    // The listener and its directory go: nothing else can connect.
                    let (read, write) = stream.into_split();
                    self.link = Link::Socket(read, write);
                }
                Heard::Connected(Err(e)) => {
                    tracing::warn!(container = %self.id, error = %e, "accepting the driver's connection failed; listening to its stdout");
                    self.link = Link::Attach;
                }
                // The container's stdio already closed: it has exited.
                Heard::Socket(Ok(0)) if self.stdio_closed => return Ok(None),
                Heard::Socket(Ok(0)) => self.link = Link::Closed,
                Heard::Socket(Ok(_)) => self.decoder.push(&chunk),
                Heard::Socket(Err(e)) => return Err(anyhow!(e).context("reading from the sandbox's socket")),
                Heard::Attach(None) if self.on_socket() => {
                    // The container's stdio closed; the socket says when the driver is gone.
                    self.stdio_closed = true;
                    self.output = Box::pin(futures::stream::pending());
                }
                Heard::Attach(None) => return Ok(None),
                Heard::Attach(Some(Err(e))) => return Err(anyhow!(e).context("reading from the sandbox")),
                Heard::Attach(Some(Ok(LogOutput::StdOut { message }))) => match self.link {
                    Link::Socket(..) | Link::Closed => self.keep_diagnostics(&message),
                    _ => {
                        // A driver that could not connect speaks here; stop listening.
                        self.link = Link::Attach;
                        self.decoder.push(&message);
                    }
                },
                Heard::Attach(Some(Ok(LogOutput::StdErr { message }))) => self.keep_diagnostics(&message),
                Heard::Attach(Some(Ok(_))) => {}
            }
        }
    }

    /// Whether the driver is known to be gone, learnt without waiting: for a sandbox that sat
    /// idle (in the warm pool, or bound to a tenant) before it is handed a job. A container
    /// killed meanwhile (by an operator, the engine's restart, the host's OOM killer) would
    /// otherwise take the job and fail it for a reason not the job's. Whatever the driver sent
    /// meanwhile is kept for [`Sandbox::next_event`], as if it had been waited for.
    pub fn is_gone(&mut self) -> bool {
        // Bounded: an idle driver has little to say; one that floods is not waited out here.
        for _ in 0..64 {
            // The attach stream first, in every state (as next_event reads it).
            match self.output.next().now_or_never() {
                None => {}
                Some(Some(Ok(LogOutput::StdOut { message }))) if !matches!(self.link, Link::Socket(..) | Link::Closed) => {
                    // The driver's frames (one that could not connect speaks here).
                    self.link = Link::Attach;
                    self.decoder.push(&message);
                    continue;
                }
                Some(Some(Ok(LogOutput::StdOut { message } | LogOutput::StdErr { message }))) => {
                    self.keep_diagnostics(&message);
                    continue;
                }
                Some(Some(Ok(_))) => continue,
                Some(None) if self.on_socket() => {
                    // The container's stdio closed; the socket says whether the driver is gone.
                    self.stdio_closed = true;
                    self.output = Box::pin(futures::stream::pending());
                }
                Some(None | Some(Err(_))) => {
                    // Ended for good: later polls see the end again, not a finished stream.
                    self.output = Box::pin(futures::stream::empty());
                    return true;
                }
            }
            return match &mut self.link {
                Link::Closed => true,
                Link::Attach | Link::Pending(_) => false,
                Link::Socket(read, _) => {
                    let mut chunk = [0u8; 4096];
                    match read.try_read(&mut chunk) {
                        Ok(0) => true,
                        Ok(n) => {
                            self.decoder.push(&chunk[..n]);
                            continue;
                        }
                        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                    }
                }
            };
        }
        false
    }

    fn keep_diagnostics(&mut self, message: &[u8]) {
        let room = MAX_DIAGNOSTICS.saturating_sub(self.diagnostics.len());
        self.diagnostics.extend_from_slice(&message[..message.len().min(room)]);
    }

    /// What the driver wrote to its own stderr (diagnostics, not user output), capped.
    pub fn diagnostics(&self) -> String {
        String::from_utf8_lossy(&self.diagnostics).into_owned()
    }

    /// Send SIGINT to the driver (through tini, PID 1, which forwards it): the running cell
    /// gets a `KeyboardInterrupt`, the kernel and its variables survive.
    pub async fn interrupt(&mut self) {
        if let Err(e) = self.docker.kill_container(&self.id, Some(KillContainerOptions { signal: "SIGINT".into() })).await {
            tracing::debug!(container = %self.id, error = %e, "interrupt failed (already stopped?)");
        }
    }

    /// Like [`Sandbox::diagnostics`], and forget them (a session logs each cell's own).
    pub fn take_diagnostics(&mut self) -> String {
        let d = self.diagnostics();
        self.diagnostics.clear();
        d
    }

    /// Kill the container now (a wall-clock timeout, or a protocol violation); nothing more is
    /// read from it. The attach connection is closed first: a sandbox that wrote more than the
    /// worker read leaves Docker blocked writing to it, and Docker then holds the kill (and the
    /// removal) until its own timeout.
    pub async fn kill(&mut self) {
        self.hang_up();
        if let Err(e) = self.docker.kill_container(&self.id, Some(KillContainerOptions { signal: "KILL".into() })).await {
            tracing::debug!(container = %self.id, error = %e, "kill failed (already stopped?)");
        }
    }

    /// How the container ended (OOM, exit code). Waits briefly for Docker to notice the exit.
    pub async fn exit_state(&mut self) -> ExitState {
        for _ in 0..20 {
            match self.docker.inspect_container(&self.id, None::<InspectContainerOptions>).await {
                Ok(info) => {
                    let state = info.state.unwrap_or_default();
                    if state.running != Some(true) {
                        return ExitState { oom_killed: state.oom_killed.unwrap_or(false), exit_code: state.exit_code };
                    }
                }
                Err(e) => {
                    tracing::warn!(container = %self.id, error = %e, "inspecting sandbox failed");
                    return ExitState::default();
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        ExitState::default()
    }

    /// Remove the container and its workspace.
    pub async fn destroy(mut self) {
        self.guard.id = None;
        self.hang_up();
        remove(&self.docker, &self.id).await;
    }

    /// Close the attach connection and the socket: from here on the driver can neither be
    /// heard nor told.
    fn hang_up(&mut self) {
        self.link = Link::Attach;
        self.output = Box::pin(futures::stream::empty());
        self.input = None;
    }
}

/// What [`Sandbox::next_event`] heard first.
enum Heard {
    Connected(std::io::Result<tokio::net::UnixStream>),
    Socket(std::io::Result<usize>),
    Attach(Option<Result<LogOutput, bollard::errors::Error>>),
}

/// Removes a container when dropped while still holding its id: covers a start-up that fails
/// half way and a [`Sandbox`] dropped on an unexpected path.
struct RemoveOnDrop {
    docker: Docker,
    id: Option<String>,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let docker = self.docker.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move { remove(&docker, &id).await });
            }
        }
    }
}

/// Longest wait for Docker to remove a container (a job never waits forever on Docker; a
/// container left behind is removed by the next start's sweep).
const REMOVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

async fn remove(docker: &Docker, id: &str) {
    let opts = RemoveContainerOptions { force: true, v: true, link: false };
    match tokio::time::timeout(REMOVE_TIMEOUT, docker.remove_container(id, Some(opts))).await {
        Ok(Ok(())) => tracing::debug!(container = %id, "sandbox removed"),
        Ok(Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. })) => {}
        Ok(Err(e)) => tracing::warn!(container = %id, error = %e, "removing sandbox failed"),
        Err(_) => tracing::error!(container = %id, timeout_s = REMOVE_TIMEOUT.as_secs(), "Docker did not remove a sandbox in time; it is left for the sweep"),
    }
}

/// Remove every container labelled as this worker's (left by a previous run that died).
pub async fn remove_leftovers(docker: &Docker, worker_id: &str) -> Result<usize> {
    let filters = HashMap::from([("label".to_string(), vec![format!("{LABEL_WORKER}={worker_id}")])]);
    let list = docker
        .list_containers(Some(ListContainersOptions { all: true, filters: Some(filters), ..Default::default() }))
        .await
        .context("listing leftover sandboxes")?;
    for c in &list {
        if let Some(id) = &c.id {
            remove(docker, id).await;
        }
    }
    Ok(list.len())
}
