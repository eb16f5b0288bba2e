//! stowage: a lock and storage manager for a shared directory of build
//! images.
//!
//! Many builds at once — on one host, or many hosts sharing NFS or Lustre —
//! read base images and write new ones in one directory. stowage gives each
//! build the locks it needs (*flat locking*: one flock(2) lock per image,
//! plus one global lock guarding the SQLite metadata), so builds run in
//! parallel, base images are stored once, and no build reads an image that
//! another is writing.
//!
//! # Architecture
//! - [`lock`] is the only module that calls flock(2): guards, bounded and
//!   cancellable waits, the unlink-race check.
//! - [`store`] owns the global lock and the metadata ([`meta`]); a metadata
//!   transaction cannot exist without the global lock.
//! - [`session`] is the exec protocol; [`status`] judges recorded holders
//!   against the kernel ([`kernel`]), which is the truth, and each record's
//!   liveness by its owner's [`lease`] — never by a pid.
//! - [`signals`] routes termination signals to the command and lets long
//!   work stop for them; [`keeper`] runs the command for `--no-inherit`, so
//!   that its whole process tree is gone before the locks are released.
//! - [`cli`] is the command line, one file per command.
//!
//! # Lock order
//! **slots → image locks in ascending encoded-name order → global lock.**
//! The global lock is held only for one short metadata transaction; while it
//! is held a process may *try* image locks, never wait for one. Store-wide
//! operations (schema migration, [`store_wide`] holds for a whole command)
//! conflict with every image lock; a store-wide hold's lease
//! (`locks/store.lock`) is waited for only by a process holding nothing.
//!
//! # Example
//! ```no_run
//! use stowage::{ImageName, Root, Store, session::{Request, Session, Outcome}};
//!
//! let mut store = Store::new(Root::at("/var/tmp/me.stowage"));
//! let req = Request {
//!     reads: vec![ImageName::parse("alpine:3.17")?],
//!     writes: vec![ImageName::parse("app")?],
//!     command: "my-builder".into(),
//!     ..Request::default()
//! };
//! let session = Session::begin(&mut store, &req)?;
//! // ... build into session.image_dir(&ImageName::parse("app")?) ...
//! session.finish(&mut store, Outcome::Success)?;
//! # Ok::<(), anyhow::Error>(())
//! ```

pub mod acquire;
pub mod adopt;
pub mod cli;
pub mod clock;
pub mod clone;
pub mod ctx;
pub mod debug;
pub mod dir;
pub mod disk_usage;
pub mod doctor;
pub mod env;
pub mod error;
pub mod filesystem;
pub mod gc;
pub mod holders;
pub mod ident;
pub mod judge;
pub mod keeper;
pub mod kernel;
pub mod lease;
pub mod lock;
pub mod meta;
pub mod name;
pub mod nested;
pub mod remove;
pub mod root;
pub mod session;
pub mod signals;
pub mod slots;
pub mod space;
pub mod spawn;
pub mod store;
pub mod store_wide;
pub mod tree;

pub use error::Error;
pub use name::ImageName;
pub use root::Root;
pub use store::Store;
