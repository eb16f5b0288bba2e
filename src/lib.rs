//! stowage: a lock and storage manager for a shared directory of build images. Builds on one host
//! or many (NFS, Lustre) read base images and write new ones in parallel: one flock(2) lock per
//! image, plus a global lock for the catalog; bases are stored once, and no build reads an image
//! that another is writing. Design: docs/design.md.
//!
//! # One fact, one home
//! - An image's state, base, creation, writer's outcome: its record ([`image_record`]), written
//!   under its exclusive lock, synced before it goes.
//! - Who holds and awaits what: the kernel's locks, named by leases ([`lease`], [`holders`]).
//! - A slot class's limits: its record ([`slot_limits`]).
//! - Where trees go, and the store's identity: [`config`].
//! - Names, lineage, last use, sizes: the [`catalog`], derived; losing it costs a rebuild.
//!
//! # Map of the modules, by floor
//! A module uses only its floor or below (tests/layout.rs checks).
//!
//! 1. **Ground**: [`env`](mod@env) every `STOWAGE_*` variable; [`name`] image names; [`clock`];
//!    [`ident`] who this process is; [`error`] typed errors and exit codes; [`filesystem`] where a
//!    lock reaches; [`space`] the reserve file; [`spawn`]; [`planted`] what is found where
//!    stowage keeps a file of its own; [`system_dirs`] no place for a store.
//! 2. **Locks and processes**: [`lock`] the only caller of flock(2); [`signals`]; [`debug`] test
//!    pause points; [`image_record`] an image's record; [`slot_limits`] a class's record; [`lease`]
//!    holder leases; [`kernel`] /proc/locks; [`keeper`] `--no-inherit`; [`command`]; [`dir`]
//!    descriptor-based walks; [`disk_usage`]; [`clone`] copying a tree; [`loan`] its loans of access.
//! 3. **Layout**: [`config`] `store.conf`; [`root`] every path of the layout; [`images_dir`] where
//!    trees are; [`claim`] which store an images directory serves; [`catalog`] SQLite; [`census`]
//!    every record in one pass; [`ctx`]; [`sharing`] the modes of a group store.
//! 4. **Who holds what**: [`holders`] leases and the lock table, and how to say them; [`nested`]
//!    holds of an enclosing exec; [`store`] the global lock and catalog transactions; [`wait_line`]
//!    a wait you can follow; [`wait_chain`] why a process waits (`lock-status --why`).
//! 5. **Taking locks**: [`acquire`] image and slot locks; [`store_wide`] holds of the whole store;
//!    [`slots`] slot classes.
//! 6. **Operations**: [`remove`]; [`adopt`]; [`migrate`] stores of releases before records;
//!    [`survey`] every image with its catalog row; [`gc`]; [`doctor`].
//! 7. **Exec**: [`session`] the exec protocol; [`exec`] a plan to an exit code.
//! 8. **[`cli`]**: one file per command.
//!
//! # Lock order
//! **slots → image locks in ascending encoded-name order → global lock.**
//! Under the global lock (one short transaction) a lock is only tried, never waited for;
//! `store.lock` is waited for only holding nothing.
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
pub mod catalog;
pub mod census;
pub mod claim;
pub mod cli;
pub mod clock;
pub mod clone;
pub mod command;
pub mod config;
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
pub mod image_record;
pub mod images_dir;
pub mod keeper;
pub mod kernel;
pub mod lease;
pub mod loan;
pub mod lock;
pub mod migrate;
pub mod name;
pub mod nested;
pub mod planted;
pub mod remove;
pub mod root;
pub mod session;
pub mod sharing;
pub mod signals;
pub mod slot_limits;
pub mod slots;
pub mod space;
pub mod spawn;
pub mod store;
pub mod store_wide;
pub mod survey;
pub mod system_dirs;
pub mod wait_chain;
pub mod wait_line;

pub use error::Error;
pub use name::ImageName;
pub use root::Root;
pub use store::Store;
