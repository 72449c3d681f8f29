//! The direct channel to a sandbox's driver: a Unix socket the worker listens on, in a
//! directory of its own bind-mounted into the container, in place of Docker's attach stream.
//!
//! Over the attach stream every frame crosses two more processes each way (Docker's daemon and
//! the container's shim) and a multiplexed HTTP stream; over the socket it goes straight from
//! the driver to the worker (about 1.5 ms less per `1+1` cell, and the daemon's CPU; see
//! ARCHITECTURE.md, "The driver's channel").
//!
//! How it is set up, and why it is safe:
//! - before the container is created, the worker makes `<SANDCELL_CHANNEL_DIR>/<worker>/<random>`
//!   (mode 0700, root's; `<worker>` is a hash of the worker's id, so that a long id cannot push
//!   the socket's path past the 107 bytes a Unix socket's address holds) and listens on
//!   `worker.sock` in it; the container gets the directory
//!   at [`MOUNT_POINT`] and the socket's path in `SANDCELL_CHANNEL`;
//! - the driver connects before it starts the kernel, as root: the sandbox user's code (uid
//!   1000) can neither traverse the directory nor connect. The worker takes the first
//!   connection only, then removes the socket and the directory: no second peer can appear;
//! - where the driver cannot connect (gVisor does not connect to host sockets; a worker whose
//!   directory is not the Docker host's), it speaks on its stdio as before, and the worker,
//!   listening on both until the first frame, follows it. Nothing has to be configured per
//!   runtime, and a sandbox never waits on a channel that cannot come.
//!
//! The attach stream stays open either way: the driver's stderr (its diagnostics) still comes
//! through it, and is read all along so the driver never blocks on a full pipe.

use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tokio::net::{UnixListener, UnixStream};

/// Where the channel's directory appears inside the container.
pub const MOUNT_POINT: &str = "/run/sandcell";
/// The socket's name in that directory.
const SOCKET_NAME: &str = "worker.sock";
/// Hex digits naming a worker's directory (a hash of its id) and a sandbox's (random).
const NAME_HEX: usize = 16;
/// The longest path a Unix socket's address holds (`sun_path`, 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The directory name of `worker_id`'s channels: a hash, the same on every start of the worker
/// (a restart empties what the last run left), as short whatever the id.
fn worker_dir_name(worker_id: &str) -> String {
    use sha2::Digest;
    let digest = hex::encode(sha2::Sha256::digest(worker_id.as_bytes()));
    digest[..NAME_HEX].to_string()
}

/// The path a sandbox's socket gets under the worker's directory `dir`, at its longest.
fn socket_path_len(dir: &Path) -> usize {
    dir.as_os_str().len() + 1 + NAME_HEX + 1 + SOCKET_NAME.len()
}

/// This worker's channel directories: `<SANDCELL_CHANNEL_DIR>/<worker id>`.
#[derive(Debug, Clone)]
pub struct ChannelRoot {
    dir: PathBuf,
}

impl ChannelRoot {
    /// The root for `worker_id` under `base`, emptied of what a previous run of the worker
    /// left. `None` (the attach stream is used, with a warning) when it cannot be made, or when
    /// `base` is so long that a socket under it could not be bound.
    pub fn prepare(base: &Path, worker_id: &str) -> Option<ChannelRoot> {
        let dir = base.join(worker_dir_name(worker_id));
        if socket_path_len(&dir) > MAX_SOCKET_PATH {
            tracing::warn!(
                dir = %dir.display(),
                max = MAX_SOCKET_PATH,
                "the sandboxes' sockets would not fit a Unix socket's address under this directory (shorten SANDCELL_CHANNEL_DIR); drivers speak over Docker's attach stream"
            );
            return None;
        }
        let made = match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
        .and_then(|()| std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir));
        match made {
            Ok(()) => {
                tracing::info!(worker_id, dir = %dir.display(), "the sandboxes' channel directory");
                Some(ChannelRoot { dir })
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot prepare the sandboxes' channel directory; drivers speak over Docker's attach stream");
                None
            }
        }
    }

    /// A fresh directory with a listening socket, for one sandbox.
    pub fn listen(&self) -> Result<Listening> {
        let dir = self.dir.join(&uuid::Uuid::new_v4().simple().to_string()[..NAME_HEX]);
        std::fs::DirBuilder::new().mode(0o700).create(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let guard = RemoveDir(dir.clone());
        let socket = dir.join(SOCKET_NAME);
        let listener = UnixListener::bind(&socket).with_context(|| format!("listening on {}", socket.display()))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)).context("restricting the channel socket")?;
        Ok(Listening { listener, dir: guard })
    }
}

/// A sandbox's socket, waiting for its driver.
#[derive(Debug)]
pub struct Listening {
    listener: UnixListener,
    dir: RemoveDir,
}

impl Listening {
    /// The bind mount for the container (`host:container`).
    pub fn bind(&self) -> String {
        format!("{}:{MOUNT_POINT}:rw", self.dir.0.display())
    }

    /// The socket's path inside the container (the driver's `SANDCELL_CHANNEL`).
    pub fn path_in_container() -> String {
        format!("{MOUNT_POINT}/{SOCKET_NAME}")
    }

    /// The driver's connection: the first one, after which the socket and its directory are
    /// gone.
    pub async fn accept(&self) -> io::Result<UnixStream> {
        self.listener.accept().await.map(|(stream, _)| stream)
    }
}

/// Removes a directory (and the socket in it) when dropped.
#[derive(Debug)]
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::debug!(dir = %self.0.display(), error = %e, "cannot remove a channel directory");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_sandbox_socket_is_root_only_and_gone_once_its_listener_is() {
        let base = std::env::temp_dir().join(format!("sandcell-channel-test-{}", uuid::Uuid::new_v4().simple()));
        let root = ChannelRoot::prepare(&base, "w1").expect("prepared");
        let listening = root.listen().expect("listening");
        let dir = listening.dir.0.clone();
        let socket = dir.join(SOCKET_NAME);
        assert_eq!(std::fs::metadata(&dir).expect("dir").permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(&socket).expect("socket").permissions().mode() & 0o777, 0o600);
        assert!(listening.bind().ends_with(":/run/sandcell:rw"), "{}", listening.bind());

        let mut client = UnixStream::connect(&socket).await.expect("connect");
        let mut server = listening.accept().await.expect("accept");
        client.write_all(b"ping").await.expect("write");
        let mut got = [0u8; 4];
        server.read_exact(&mut got).await.expect("read");
        assert_eq!(&got, b"ping");

        drop(listening);
        assert!(!dir.exists(), "the directory outlived its listener");
        // A restarted worker starts from an empty root.
        std::fs::create_dir(root.dir.join("left-over")).expect("mkdir");
        let again = ChannelRoot::prepare(&base, "w1").expect("prepared again");
        assert_eq!(std::fs::read_dir(&again.dir).expect("read").count(), 0);
        std::fs::remove_dir_all(&base).expect("cleanup");
    }

    #[tokio::test]
    async fn a_long_worker_id_still_gets_a_socket_a_driver_can_connect_to() {
        // The default channel directory and a worker id of 64 characters: joined as they are,
        // the socket's path would be past what a Unix socket's address holds.
        let base = std::env::temp_dir().join(format!("sandcell-channel-test-{}", uuid::Uuid::new_v4().simple()));
        let worker_id = "sandcell-worker-7d9f8b6c5d-x2k4q-0123456789abcdef0123456789abcdef";
        let root = ChannelRoot::prepare(&base, worker_id).expect("prepared");
        let listening = root.listen().expect("listening");
        let socket = listening.dir.0.join(SOCKET_NAME);
        assert!(socket.as_os_str().len() <= MAX_SOCKET_PATH, "{}", socket.display());
        let _client = UnixStream::connect(&socket).await.expect("connect");
        listening.accept().await.expect("accept");
        // Another worker's id: another directory.
        let other = ChannelRoot::prepare(&base, "w2").expect("prepared");
        assert_ne!(other.dir, root.dir);
        std::fs::remove_dir_all(&base).expect("cleanup");
    }

    #[test]
    fn a_channel_directory_too_long_for_a_socket_is_refused_up_front() {
        let base = PathBuf::from(format!("/tmp/{}", "d".repeat(80)));
        assert!(ChannelRoot::prepare(&base, "w1").is_none());
        assert!(!base.exists());
    }
}
