//! Integration tests: the real binary, real processes, a real directory.
//! One test binary with modules keeps link time down.

mod common;

mod adversarial_files;
mod adversarial_leases;
mod adversarial_procs;
mod charliecloud;
mod concurrency;
mod crash;
mod data;
mod docs;
mod exec;
mod fairness;
mod files;
mod hostile;
mod init;
mod leases;
mod lifecycle;
mod lock_status;
mod locks;
mod migration;
mod names;
mod procs;
mod runtimes;
mod shell;
mod slots;
mod store_wide;
mod stress;
