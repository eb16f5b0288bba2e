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
//! # Map of the modules, by floor
//! A module uses only modules on its own floor or below; the exec path
//! reads downward: `cli::exec` (arguments → [`exec::Plan`]) → [`exec`] →
//! [`session`] → [`acquire`] → [`lock`] and [`meta`]. No import circles.
//!
//! 1. **Ground** (no store state): [`env`](mod@env) every `STOWAGE_*` variable;
//!    [`name`] image names; [`clock`]; [`ident`] who this process is;
//!    [`error`] typed errors and exit codes; [`filesystem`] the statfs and
//!    mount table, where a lock reaches; [`space`] the reserve file;
//!    [`spawn`] posix_spawn.
//! 2. **Locks and processes**: [`lock`] the only caller of flock(2)
//!    (guards, `acquire`/`acquire_no_wait`, the unlink race;
//!    `lock/wait.rs` the waiting engine); [`signals`] termination signals
//!    routed to the command, cancelling waits; [`lease`] holder leases;
//!    [`kernel`] /proc/locks; [`nested`] holds of an enclosing exec;
//!    [`keeper`] `--no-inherit`; [`command`] starting and waiting for the
//!    command; [`dir`], [`tree`] descriptor-based walks; [`debug`] test
//!    pause points.
//! 3. **Layout and metadata**: [`root`] every path of the layout; [`meta`]
//!    all SQL; [`record`] the ready token in an image's lock file (how a
//!    read learns "ready" without the database); [`slot_record`] a slot
//!    class's limits in its slot files (how a slot is taken without it);
//!    [`records_db`] which database those records speak for (why they are
//!    trusted without reading its header); [`written`] writes without the
//!    database: markers, and their fold into the rows at every
//!    transaction; [`ctx`] what every operation needs; [`disk_usage`];
//!    [`adopt`] trees without rows; [`clone`] copying a tree.
//! 4. **Who holds what**: [`holders`] parties and how to say them (the one
//!    "waiting for …" announcement); [`judge`] records against the kernel,
//!    dropping stale ones; [`store`] the global lock and transactions;
//!    [`store_wide`] `exec --store-wide`.
//! 5. **Operations**: [`remove`] rm and its recovery; [`slots`] slot
//!    classes; [`gc`]; [`doctor`]; [`acquire`] image and slot locks, gates,
//!    waiter records; [`idle`] lock-status while nothing is held, without
//!    the database.
//! 6. **Exec**: [`session`] the exec protocol (begin, copy, finish,
//!    abandon); [`exec`] a plan to an exit code.
//! 7. **[`cli`]**: one file per command; arguments become a validated
//!    request, then the library runs it. Output shapes live with the
//!    command that prints them.
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
pub mod command;
pub mod ctx;
pub mod debug;
pub mod dir;
pub mod disk_usage;
pub mod doctor;
pub mod env;
pub mod error;
pub mod exec;
pub mod filesystem;
pub mod gc;
pub mod holders;
pub mod ident;
pub mod idle;
pub mod judge;
pub mod keeper;
pub mod kernel;
pub mod lease;
pub mod lock;
pub mod meta;
pub mod name;
pub mod nested;
pub mod record;
pub mod records_db;
pub mod remove;
pub mod root;
pub mod session;
pub mod signals;
pub mod slot_record;
pub mod slots;
pub mod space;
pub mod spawn;
pub mod store;
pub mod store_wide;
pub mod tree;
pub mod written;

pub use error::Error;
pub use name::ImageName;
pub use root::Root;
pub use store::Store;
