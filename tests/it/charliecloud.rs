//! Charliecloud: `scripts/ch-build` and stowage around the real ch-image, with
//! many builds in one storage directory.
//!
//! Each test makes a storage directory holding a busybox base image imported
//! from a tarball made here (no network), adopted by
//! `stowage init --images-dir STORAGE/img`. Builds wait inside their RUN step
//! for a sentinel file the test writes into the image being built, so "these
//! builds run at once" and "this one waits" are observed, never timed. Tests
//! that run ch-image skip, saying why, where ch-image, ch-run, git or a static
//! busybox is missing or containers cannot run.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::common::*;

pub(crate) const CH_BUILD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ch-build");
pub(crate) const CH_DELETE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ch-delete");

/// A store whose images live in a Charliecloud storage directory.
pub(crate) struct Ch {
    pub(crate) env: Env,
    pub(crate) storage: PathBuf,
    pub(crate) ctx: PathBuf,
    /// ch-build runs with an `unshare` that always fails, as on a host
    /// where no user or mount namespace can be made ([`Ch::no_namespaces`]).
    no_ns: std::cell::Cell<bool>,
}

impl Ch {
    /// Storage with the base image `base` imported and adopted, or `None`
    /// (after saying why) where this machine cannot build with ch-image.
    pub(crate) fn new() -> Option<Ch> {
        let ch = Ch::unadopted()?;
        ch.adopt();
        Some(ch)
    }

    /// Storage with the base image `base` imported that no stowage root
    /// keeps yet (the store's root does not exist), or `None` as for
    /// [`Ch::new`].
    pub(crate) fn unadopted() -> Option<Ch> {
        let ch = Ch::empty();
        if let Some(why) = ch.missing_tools() {
            eprintln!("skipping: {why}");
            return None;
        }
        ch.import_base();
        let mut run = ch.command("ch-run");
        run.arg("-s")
            .arg(&ch.storage)
            .args(["base", "--", "/bin/true"]);
        let probe = output(run);
        if !probe.status.success() {
            eprintln!(
                "skipping: ch-run cannot run a container here (no user namespaces?): {}",
                stderr(&probe).trim()
            );
            return None;
        }
        Some(ch)
    }

    /// A storage directory path and a context directory; nothing imported.
    fn empty() -> Ch {
        let env = Env::new();
        let storage = env.tmp.path().join("storage");
        let ctx = env.tmp.path().join("ctx");
        fs::create_dir(&ctx).unwrap();
        Ch {
            env,
            storage,
            ctx,
            no_ns: std::cell::Cell::new(false),
        }
    }

    /// From now on ch-build finds an `unshare` that fails: it cannot give a
    /// build a private copy of a base's ch/, and locks an unlinked base
    /// exclusively instead.
    pub(crate) fn no_namespaces(&self) {
        let dir = self.env.tmp.path().join("no-unshare");
        fs::create_dir_all(&dir).unwrap();
        let f = dir.join("unshare");
        fs::write(
            &f,
            "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&f, fs::Permissions::from_mode(0o755)).unwrap();
        self.no_ns.set(true);
    }

    /// Whether ch-build can run a build in a mount namespace of its own with
    /// a tmpfs in it (its own test, on the images directory).
    fn private_ch_works(&self) -> bool {
        let mut c = self.command("sh");
        c.args([
            "-c",
            "if [ \"$(id -u)\" = 0 ]; then unshare --mount mount -t tmpfs p \"$1\"; \
             else unshare --user --map-root-user --mount mount -t tmpfs p \"$1\"; fi",
            "sh",
        ])
        .arg(self.storage.join("img"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        c.status().is_ok_and(|s| s.success())
    }

    fn missing_tools(&self) -> Option<String> {
        for (prog, why) in [
            (
                "ch-image",
                "ch-image (Debian package charliecloud-builders)",
            ),
            ("ch-run", "ch-run (Debian package charliecloud-runtime)"),
            ("git", "git (ch-image's build cache)"),
        ] {
            let found = self
                .command(prog)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !found {
                return Some(format!("{why} is not installed"));
            }
        }
        if !Path::new("/bin/busybox").is_file() {
            return Some("/bin/busybox is missing (Debian package busybox-static)".into());
        }
        None
    }

    /// A tiny root filesystem tarball from the host's static busybox,
    /// imported before anything else uses the storage: an import in
    /// ch-image's default (cache) mode links the image to the build cache,
    /// so builds only read it — but it briefly adds `imgtmp` to the storage
    /// directory, which no other ch-image command may see.
    fn import_base(&self) {
        let mut import = self.ch_image(["import"]);
        import.arg(self.base_tarball()).arg("base");
        assert_ok(output(import));
    }

    /// The tarball [`Ch::import_base`] imports, made once.
    fn base_tarball(&self) -> PathBuf {
        let tarball = self.env.tmp.path().join("base.tar");
        if tarball.exists() {
            return tarball;
        }
        let rootfs = self.env.tmp.path().join("rootfs");
        for d in ["bin", "etc", "tmp", "root"] {
            fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        fs::copy("/bin/busybox", rootfs.join("bin/busybox")).unwrap();
        for applet in [
            "sh", "echo", "cat", "ls", "mkdir", "rm", "touch", "true", "false", "sleep", "test",
            "[",
        ] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        fs::write(
            rootfs.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        )
        .unwrap();
        fs::write(rootfs.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n").unwrap();
        let mut tar = Command::new("tar");
        tar.arg("-C").arg(&rootfs).arg("-cf").arg(&tarball).arg(".");
        assert_ok(output(tar));
        tarball
    }

    /// `stowage init --images-dir STORAGE/img`, adopting `base`.
    fn adopt(&self) {
        let out = self.env.ok([
            OsStr::new("init"),
            OsStr::new("--images-dir"),
            self.storage.join("img").as_os_str(),
        ]);
        assert!(stderr(&out).contains("adopted 1"), "{}", show(&out));
    }

    /// A command with what ch-image needs (Debian's python first in PATH,
    /// $USER, a git identity for cache-mode imports) and the built stowage
    /// in PATH, for `scripts/ch-build`.
    pub(crate) fn command(&self, prog: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new(prog);
        let bin_dir = Path::new(bin()).parent().unwrap();
        let path = std::env::var("PATH").unwrap_or_default();
        c.env("PATH", format!("{}:/usr/bin:{path}", bin_dir.display()))
            .env("USER", user())
            .env("CH_IMAGE_STORAGE", &self.storage)
            .env("STOWAGE_ROOT", &self.env.root)
            .env_remove("CH_IMAGE_CACHE")
            .env_remove("STOWAGE_NOW");
        for v in ["GIT_AUTHOR", "GIT_COMMITTER"] {
            c.env(format!("{v}_NAME"), "stowage tests")
                .env(format!("{v}_EMAIL"), "tests@stowage.invalid");
        }
        c.stdin(Stdio::null());
        c
    }

    /// `ch-image -s STORAGE ARGS…` (with ch-image's own lock: only for
    /// commands that run while nothing else uses the storage).
    fn ch_image<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> Command {
        let mut c = self.command("ch-image");
        c.arg("-s").arg(&self.storage).args(args);
        c
    }

    /// `stowage ARGS…` with the environment ch-image needs.
    fn stowage<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> Command {
        let mut c = self.command(bin());
        c.arg("--root").arg(&self.env.root).args(args);
        c
    }

    /// `scripts/ch-build ARGS… CTX`.
    pub(crate) fn ch_build<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> Command {
        let mut c = self.ch_build_command();
        c.args(args).arg(&self.ctx);
        c
    }

    /// `scripts/ch-build`, without an `unshare` that works after
    /// [`Ch::no_namespaces`].
    fn ch_build_command(&self) -> Command {
        let mut c = self.command(CH_BUILD);
        if self.no_ns.get() {
            let bin_dir = Path::new(bin()).parent().unwrap();
            let path = std::env::var("PATH").unwrap_or_default();
            c.env(
                "PATH",
                format!(
                    "{}:{}:/usr/bin:{path}",
                    self.env.tmp.path().join("no-unshare").display(),
                    bin_dir.display()
                ),
            );
        }
        c
    }

    /// `scripts/ch-build -t TAG --build-arg ID=ID` in the background.
    pub(crate) fn build(&self, tag: &str, id: &str) -> Bg {
        Bg::from_command(self.ch_build(["-t", tag, "--build-arg", &format!("ID={id}")]))
    }

    pub(crate) fn dockerfile(&self, name: &str, text: &str) -> String {
        let p = self.ctx.join(name);
        fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    /// An image's directory (names here need no encoding).
    pub(crate) fn img(&self, name: &str) -> PathBuf {
        self.storage.join("img").join(name)
    }

    pub(crate) fn wait_started(&self, tag: &str, id: &str) {
        wait_for_file(&self.img(tag).join(format!("started-{id}")));
    }

    pub(crate) fn go(&self, tag: &str, id: &str) {
        fs::write(self.img(tag).join(format!("go-{id}")), "").unwrap();
    }

    pub(crate) fn file(&self, tag: &str, path: &str) -> String {
        fs::read_to_string(self.img(tag).join(path))
            .unwrap_or_else(|e| panic!("{tag}:/{path}: {e}"))
            .trim()
            .to_owned()
    }

    /// What `ch-image list` shows.
    fn ch_list(&self) -> Vec<String> {
        let out = output(self.ch_image(["--no-lock", "--no-cache", "list"]));
        assert_ok_ref(&out);
        let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        v.sort();
        v
    }

    /// What `stowage images` shows.
    fn stowage_list(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .env
            .images_json()
            .iter()
            .map(|i| i["name"].as_str().unwrap().to_owned())
            .collect();
        v.sort();
        v
    }

    fn waiters(&self, image: &str) -> Vec<Value> {
        self.env
            .lock_entry(image)
            .map(|e| e["waiters"].as_array().unwrap().clone())
            .unwrap_or_default()
    }
}

fn user() -> String {
    std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| {
            let out = Command::new("id").arg("-un").output().expect("id -un");
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        })
}

pub(crate) fn assert_ok(out: std::process::Output) {
    assert_ok_ref(&out);
}

pub(crate) fn assert_ok_ref(out: &std::process::Output) {
    assert_eq!(out.status.code(), Some(0), "{}", show(out));
}

/// A Dockerfile FROM `base` whose RUN records its build argument ID, then
/// waits (bounded, 60 s) until the test writes `/go-ID` into the image.
pub(crate) fn gated(base: &str) -> String {
    format!(
        "FROM {base}\nARG ID\n\
         RUN echo \"$ID\" > /id && touch \"/started-$ID\" && i=0 && \
         while [ ! -e \"/go-$ID\" ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done && \
         rm \"/go-$ID\" \"/started-$ID\"\n"
    )
}

/// Builds app0..appN-1 FROM `base` at once with the [`gated`] Dockerfile.
/// While all N are inside their RUN step, `base` must be locked shared by
/// exactly N holders; then they are let go and each must succeed.
fn build_in_parallel_from(ch: &Ch, base: &str, n: usize) {
    ch.dockerfile("Dockerfile", &gated(base));
    let builds: Vec<Bg> = (0..n)
        .map(|i| ch.build(&format!("app{i}"), &i.to_string()))
        .collect();
    for i in 0..n {
        ch.wait_started(&format!("app{i}"), &i.to_string());
    }
    // All of them are inside their RUN step at once, each reading the base.
    let entry = ch.env.lock_entry(base).unwrap();
    assert_eq!(entry["state"], "shared", "{entry}");
    assert_eq!(entry["holders"].as_array().unwrap().len(), n, "{entry}");
    for i in 0..n {
        ch.go(&format!("app{i}"), &i.to_string());
    }
    for b in builds {
        assert_ok(b.finish());
    }
}

#[test]
fn parallel_builds_from_one_base_share_it() {
    let Some(ch) = Ch::new() else { return };
    const N: usize = 6;
    build_in_parallel_from(&ch, "base", N);
    for i in 0..N {
        assert_eq!(ch.file(&format!("app{i}"), "id"), i.to_string());
        assert!(!ch.img(&format!("app{i}")).join(format!("go-{i}")).exists());
    }

    // ch-image and stowage agree, and the base is stored once.
    let mut want: Vec<String> = (0..N).map(|i| format!("app{i}")).collect();
    want.push("base".into());
    assert_eq!(ch.ch_list(), want);
    assert_eq!(ch.stowage_list(), want);
    for img in ch.env.images_json() {
        assert_eq!(img["state"], "ready", "{img}");
        assert_eq!(img["in_use"], false, "{img}");
    }
    assert!(ch.img("base/bin/busybox").is_file());
    // Nothing of stowage's own in the storage directory: ch-image checks it.
    for e in fs::read_dir(&ch.storage).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        assert!(
            [
                "bucache", "bularge", "dlcache", "img", "lock", "ulcache", "version"
            ]
            .contains(&name.as_str()),
            "unexpected {name} in the storage directory"
        );
    }
}

#[test]
fn two_builds_of_one_tag_serialize() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    let first = ch.build("app", "first");
    ch.wait_started("app", "first");
    let second = ch.build("app", "second");
    ch.env.wait_for_waiter("app");
    // Waiting, it leaves the tree the first build is growing alone.
    assert_eq!(ch.file("app", "id"), "first");
    assert!(ch.img("app/started-first").exists());

    ch.go("app", "first");
    assert_ok(first.finish());
    ch.wait_started("app", "second");
    ch.go("app", "second");
    let out = second.finish();
    assert_ok_ref(&out);
    assert!(
        stderr(&out).contains("waiting for write lock on image 'app'"),
        "{}",
        show(&out)
    );
    assert_eq!(ch.file("app", "id"), "second");
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
}

#[test]
fn deleting_a_base_waits_for_the_builds_reading_it() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    let builds: Vec<Bg> = ["a", "b"]
        .iter()
        .map(|id| ch.build(&format!("app-{id}"), id))
        .collect();
    ch.wait_started("app-a", "a");
    ch.wait_started("app-b", "b");

    let storage = ch.storage.display().to_string();
    let delete = Bg::from_command(ch.stowage([
        "exec",
        "--write",
        "base",
        "--",
        "ch-image",
        "-s",
        &storage,
        "--no-lock",
        "--no-cache",
        "delete",
        "base",
    ]));
    ch.env.wait_for_waiter("base");
    assert!(
        ch.img("base/bin/busybox").is_file(),
        "deleted under readers"
    );

    ch.go("app-a", "a");
    ch.go("app-b", "b");
    for b in builds {
        assert_ok(b.finish());
    }
    assert_ok(delete.finish());
    assert!(!ch.img("base").exists());
    assert_eq!(ch.ch_list(), ["app-a", "app-b"]);
    assert_eq!(ch.file("app-a", "id"), "a");

    // A build from the deleted base is refused before ch-image could try to
    // pull an image of that name from a registry.
    let out = output(ch.ch_build(["-t", "app-c", "--build-arg", "ID=c"]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("base image 'base' is not in"),
        "{}",
        show(&out)
    );
    assert!(!ch.img("base").exists() && !ch.img("app-c").exists());
}

/// Where no mount namespace can be made, a base without a build-cache link
/// is locked exclusively: builds FROM it run one at a time.
#[test]
fn a_base_without_a_cache_link_is_locked_exclusively_and_stays_ready() {
    let Some(ch) = Ch::new() else { return };
    ch.no_namespaces();
    // Built with --no-cache, app has no .git: every FROM app rewrites its
    // ch/metadata.json.
    let df = ch.dockerfile("Dockerfile.app", "FROM base\nRUN echo app > /app\n");
    assert_ok(output(ch.ch_build(["-t", "app", "-f", &df])));
    assert!(!ch.img("app/.git").exists());

    ch.dockerfile("Dockerfile", &gated("app"));
    let one = ch.build("one", "one");
    ch.wait_started("one", "one");
    let app = ch.env.lock_entry("app").unwrap();
    assert_eq!(app["state"], "exclusive", "{app}");
    // The holder is the build, named by its tag: no anonymous flock(1).
    let holders = app["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{app}");
    let command = holders[0]["command"].as_str().unwrap();
    assert!(
        command.contains("ch-build --locked -t one -- ch-image"),
        "{app}"
    );
    let two = ch.build("two", "two");
    ch.env.wait_for_waiter("app");
    assert!(!ch.img("two").exists(), "the second build started early");
    // The lock is exclusive, but app is only read from: it stays ready.
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));

    ch.go("one", "one");
    let out = one.finish();
    assert_ok_ref(&out);
    assert!(
        stderr(&out).contains("locking base 'app' exclusively"),
        "says why: {}",
        show(&out)
    );
    ch.wait_started("two", "two");
    ch.go("two", "two");
    let out = two.finish();
    assert_ok_ref(&out);
    assert!(
        stderr(&out).contains("lock on image 'app': held (exclusive read) by")
            && stderr(&out).contains("ch-build --locked -t one"),
        "names the build it waits for: {}",
        show(&out)
    );
    assert_eq!(ch.file("two", "app"), "app");
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));

    // A failed build from app leaves its own tag incomplete, never the base;
    // and an incomplete image is no base.
    let bad = ch.dockerfile("Dockerfile.bad", "FROM app\nRUN false\n");
    let out = output(ch.ch_build(["-t", "bad", "-f", &bad]));
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(ch.env.state("bad").as_deref(), Some("incomplete"));
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
    let df = ch.dockerfile("Dockerfile.worse", "FROM bad\nRUN true\n");
    let out = output(ch.ch_build(["-t", "worse", "-f", &df]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out)
            .contains("image 'bad' is not ready (state: incomplete, its writer's outcome: exit 1)"),
        "{}",
        show(&out)
    );
    assert!(!ch.img("worse").exists());
}

/// (Without namespaces: with them every base of a --no-cache build is read
/// shared, and the one that lost its link gets a private ch/ under the locks.)
#[test]
fn a_base_that_loses_its_cache_link_while_awaited_is_locked_anew() {
    let Some(ch) = Ch::new() else { return };
    ch.no_namespaces();
    // A reader holds base; a rewrite of base (which drops its build-cache
    // link, as a --no-cache rebuild does) queues for it.
    let reader = ch.env.hold(&["--read", "base"], "held");
    let rewrite = Bg::from_command(ch.stowage([
        "exec",
        "--write",
        "base",
        "--",
        "sh",
        "-c",
        "rm -rf \"$STOWAGE_IMAGE_DIR/.git\"",
    ]));
    wait_until("the rewrite waits for 'base'", || {
        ch.waiters("base").iter().any(|w| w["mode"] == "exclusive")
    });
    // The build plans while base is linked, and queues behind the rewrite.
    ch.dockerfile("Dockerfile", "FROM base\nRUN echo x > /x\n");
    let build = Bg::from_command(ch.ch_build(["-t", "app"]));
    wait_until("the build waits for 'base'", || {
        ch.waiters("base").iter().any(|w| w["mode"] == "shared")
    });
    ch.env.release("release");
    assert_ok(reader.finish());
    assert_ok(rewrite.finish());

    let out = build.finish();
    assert_ok_ref(&out);
    let err = stderr(&out);
    assert!(err.contains("planning again"), "{}", show(&out));
    assert!(
        err.contains("locking base 'base' exclusively"),
        "{}",
        show(&out)
    );
    assert_eq!(ch.file("app", "x"), "x");
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
    assert_eq!(ch.env.state("base").as_deref(), Some("ready"));
}

/// A root filesystem can come in while builds run: a cache-enabled build
/// `FROM scratch` + `COPY` links the new image to the build cache without
/// the `imgtmp` directory an import makes, and the one-slot class `ch-cache`
/// keeps the commands that use the build cache to one at a time.
#[test]
fn an_import_by_build_runs_beside_builds() {
    let Some(ch) = Ch::new() else { return };
    let storage = ch.storage.display().to_string();
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    assert_ok(output(ch.stowage([
        "exec",
        "--no-inherit",
        "--slot",
        "ch-cache",
        "--write",
        "scratch",
        "--",
        "ch-image",
        "-s",
        &storage,
        "--no-lock",
        "pull",
        "scratch",
    ])));
    assert!(ch.img("scratch/.git").exists());

    let import_ctx = ch.env.tmp.path().join("import");
    fs::create_dir(&import_ctx).unwrap();
    fs::rename(ch.env.tmp.path().join("rootfs"), import_ctx.join("rootfs")).unwrap();
    fs::write(
        import_ctx.join("Dockerfile"),
        gated("scratch").replace("ARG ID", "COPY rootfs/ /\nARG ID"),
    )
    .unwrap();
    let mut import = ch.stowage([
        "exec",
        "--no-inherit",
        "--slot",
        "ch-cache",
        "--read",
        "scratch",
        "--write",
        "imported",
        "--",
        "ch-image",
        "-s",
        &storage,
        "--no-lock",
        "build",
        "-t",
        "imported",
        "--build-arg",
        "ID=imp",
    ]);
    import.arg(&import_ctx);
    let import = Bg::from_command(import);
    ch.wait_started("imported", "imp");

    // Mid-import, the storage directory passes ch-image's check: new builds start.
    assert!(!ch.storage.join("imgtmp").exists());
    ch.dockerfile("Dockerfile", "FROM base\nARG ID\nRUN echo \"$ID\" > /id\n");
    let builds: Vec<Bg> = (0..3)
        .map(|i| ch.build(&format!("app{i}"), &i.to_string()))
        .collect();
    for b in builds {
        assert_ok(b.finish());
    }
    ch.go("imported", "imp");
    assert_ok(import.finish());

    // The imported image is linked, so builds from it only read it.
    assert!(ch.img("imported/.git").exists());
    ch.dockerfile("Dockerfile", "FROM imported\nRUN echo from-imported > /x\n");
    let out = output(ch.ch_build(["--dry-run", "-t", "next"]));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("--read imported --write next"),
        "{}",
        show(&out)
    );
    assert_ok(output(ch.ch_build(["-t", "next"])));
    assert_eq!(ch.file("next", "x"), "from-imported");
    assert_eq!(ch.ch_list(), ch.stowage_list());
}

/// A base built by ch-build (no build-cache link) whose /which says `name`.
fn derived(ch: &Ch, name: &str, from: &str) {
    let df = ch.dockerfile(
        &format!("Dockerfile.{name}"),
        &format!("FROM {from}\nRUN echo {name} > /which\n"),
    );
    assert_ok(output(ch.ch_build(["-t", name, "-f", &df])));
}

/// The command ch-build --dry-run prints, on one line.
fn dry_run(ch: &Ch, args: &[&str]) -> String {
    let mut c = ch.ch_build_command();
    c.arg("--dry-run").args(args);
    let out = output(c);
    assert_ok_ref(&out);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The bases come from ch-image's own resolution of the Dockerfile, so
/// ch-build locks exactly what ch-image reads — including where ch-image's
/// substitution differs from what a reader expects.
#[test]
fn ch_build_locks_the_base_ch_image_resolves() {
    let Some(ch) = Ch::new() else { return };
    ch.no_namespaces();
    derived(&ch, "base2", "base");
    derived(&ch, "mid", "base");
    // ch-image substitutes $B inside $B2: FROM $B2 is base2, not mid.
    let df = ch.dockerfile(
        "Dockerfile.args",
        "ARG B=base\nARG B2=mid\nFROM $B2\nRUN true\n",
    );
    let plan = dry_run(&ch, &["-t", "app", "-f", &df, ch.ctx.to_str().unwrap()]);
    assert!(
        plan.contains("--read-exclusive base2 --write app --"),
        "{plan}"
    );
    assert!(!plan.contains("mid"), "{plan}");
    assert_ok(output(ch.ch_build(["-t", "app", "-f", &df])));
    assert_eq!(ch.file("app", "which"), "base2");

    // FROM --arg sets the variable for that FROM only.
    let df = ch.dockerfile("Dockerfile.fromarg", "FROM --arg=b=base2 $b\nRUN true\n");
    let plan = dry_run(&ch, &["-t", "app2", "-f", &df, ch.ctx.to_str().unwrap()]);
    assert!(
        plan.contains("--read-exclusive base2 --write app2 --"),
        "{plan}"
    );
    assert_ok(output(ch.ch_build(["-t", "app2", "-f", &df])));
    assert_eq!(ch.file("app2", "which"), "base2");

    // CRLF line ends: the base is 'mid', not 'mid\r'.
    let df = ch.dockerfile(
        "Dockerfile.crlf",
        "ARG B=mid\r\nFROM $B\r\nRUN echo crlf > /crlf\r\n",
    );
    assert_ok(output(ch.ch_build(["-t", "app3", "-f", &df])));
    assert_eq!(ch.file("app3", "which"), "mid");
    assert_eq!(ch.file("app3", "crlf"), "crlf");

    // --build-arg overrides an ARG default, as ch-image applies it.
    let df = ch.dockerfile("Dockerfile.ba", "ARG B=base\nFROM $B\nRUN true\n");
    let plan = dry_run(
        &ch,
        &[
            "-t",
            "app4",
            "-f",
            &df,
            "--build-arg",
            "B=mid",
            ch.ctx.to_str().unwrap(),
        ],
    );
    assert!(
        plan.contains("--read-exclusive mid --write app4 --"),
        "{plan}"
    );
    for img in ["app", "app2", "app3", "base2", "mid"] {
        assert_eq!(ch.env.state(img).as_deref(), Some("ready"), "{img}");
    }
}

/// Whatever ch-image would refuse is refused before any lock is taken: no
/// image directory, no lock file, no row — nothing for `ch-image list` or
/// stowage to trip over afterwards.
#[test]
fn ch_build_refuses_before_taking_any_lock() {
    let Some(ch) = Ch::new() else { return };
    let img_before = tree(&ch.storage.join("img"));
    let locks_before = tree(&ch.env.root.join("locks"));
    let refused = |text: &str, tag: &str, extra: &[&str], says: &str| {
        let df = ch.dockerfile("Dockerfile.t", text);
        let mut c = ch.command(CH_BUILD);
        c.args(["-t", tag, "-f", &df]).args(extra).arg(&ch.ctx);
        let out = output(c);
        assert_eq!(out.status.code(), Some(64), "{text}: {}", show(&out));
        assert!(stderr(&out).contains(says), "{text}: {}", show(&out));
    };
    refused(
        "ARG B=base\nFROM ${B}\nRUN true\n",
        "app",
        &[],
        "can't parse",
    );
    refused(
        "FROM --platform=linux/amd64 base\nRUN true\n",
        "app",
        &[],
        "--platform",
    );
    refused("FROM base\nRUN true\n", "MyApp", &[], "image ref syntax");
    refused(
        "FROM base AS one\nRUN true\nFROM base\nRUN true\nBOGUS x\n",
        "multi",
        &[],
        "can't parse",
    );
    refused(
        "FROM base\n",
        "app",
        &["--build-arg", "X=1"],
        "not consumed: X",
    );
    refused(
        "FROM base AS build\nFROM build\n",
        "app",
        &[],
        "names an earlier stage",
    );
    refused("FROM base\nRUN true\n", "base", &[], "same as FROM");
    assert_eq!(tree(&ch.storage.join("img")), img_before);
    assert_eq!(tree(&ch.env.root.join("locks")), locks_before);
    assert_eq!(ch.stowage_list(), ["base"]);
    assert_eq!(ch.ch_list(), ["base"]);

    let out = output(ch.ch_build(["-t", "app", "-f", "/nonexistent/Dockerfile"]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    let df = ch.dockerfile("Dockerfile.t", "FROM nowhere\nRUN true\n");
    let out = output(ch.ch_build(["-t", "app", "-f", &df]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("base image 'nowhere' is not in"),
        "{}",
        show(&out)
    );
    // Locks in a root whose images are elsewhere would protect nothing; the
    // advice names the root that was given.
    let other = ch.env.tmp.path().join("other-root");
    let df = ch.dockerfile("Dockerfile.t", "FROM base\n");
    let out = output(ch.ch_build(["--root", other.to_str().unwrap(), "-t", "app", "-f", &df]));
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(
        stderr(&out).contains(&format!(
            "run: stowage --root {} init --images-dir",
            other.display()
        )),
        "{}",
        show(&out)
    );
    let mut c = ch.ch_build(["-t", "app", "-f", &df]);
    c.env("CH_IMAGE_STORAGE", "relative");
    let out = output(c);
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    // A build that fails after it started leaves its images incomplete;
    // the last stage, never reached, leaves no directory at all (its row
    // stays, incomplete), so neither `ch-image list` nor a rebuild trips
    // over an empty one.
    let df = ch.dockerfile(
        "Dockerfile.fail",
        "FROM base AS one\nRUN false\nFROM base\nRUN true\n",
    );
    let out = output(ch.ch_build(["-t", "multi", "-f", &df]));
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(ch.env.state("multi").as_deref(), Some("incomplete"));
    assert_eq!(ch.env.state("multi_stage0").as_deref(), Some("incomplete"));
    assert!(!ch.img("multi").exists());
    assert_eq!(ch.ch_list(), ["base", "multi_stage0"]);
    let df = ch.dockerfile(
        "Dockerfile.ok",
        "FROM base AS one\nRUN true\nFROM base\nRUN true\n",
    );
    assert_ok(output(ch.ch_build(["-t", "multi", "-f", &df])));
    assert_eq!(ch.env.state("multi").as_deref(), Some("ready"));
    // A storage directory that does not exist is not made by asking ch-image.
    let missing = ch.env.tmp.path().join("no-storage");
    let mut c = ch.ch_build(["-t", "app", "-f", &df]);
    c.env("CH_IMAGE_STORAGE", &missing);
    let out = output(c);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(!missing.exists());
    assert!(!ch.img("app").exists());
}

/// -v and --dry-run say which lock each image gets, and why.
#[test]
fn ch_build_explains_its_locks() {
    let Some(ch) = Ch::new() else { return };
    derived(&ch, "tools", "base");
    let df = ch.dockerfile(
        "Dockerfile.multi",
        "FROM base AS build\nRUN true\nFROM tools\nCOPY --from=build /bin/busybox /x\n",
    );
    if ch.private_ch_works() {
        let mut c = ch.ch_build(["-v", "--dry-run", "--wait", "5", "-t", "app", "-f", &df]);
        c.arg("--root").arg(&ch.env.root);
        let out = output(c);
        assert_ok_ref(&out);
        let plan = String::from_utf8_lossy(&out.stdout);
        assert!(
            plan.contains(
                "exec --wait 5 --read base --read tools --write app_stage0 --write app --"
            ),
            "{}",
            show(&out)
        );
        let err = stderr(&out);
        for says in [
            "base 'base': shared lock (--read): it is linked to the build cache",
            "base 'tools': shared lock (--read): FROM rewrites its ch/metadata.json (not linked",
            "but the build runs in a mount namespace where",
        ] {
            assert!(err.contains(says), "{says}: {err}");
        }
    } else {
        eprintln!("no mount namespace here: only the exclusive lock is checked");
    }
    ch.no_namespaces();
    let mut c = ch.ch_build(["-v", "--dry-run", "--wait", "5", "-t", "app", "-f", &df]);
    c.arg("--root").arg(&ch.env.root);
    let out = output(c);
    assert_ok_ref(&out);
    let storage = ch.storage.display();
    let ctx = ch.ctx.display();
    let root = ch.env.root.display();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!(
            "stowage --root {root} exec --wait 5 --read base --read-exclusive tools \
             --write app_stage0 --write app -- \
             ch-image -s {storage} --no-lock --no-cache build -t app -f {df} {ctx}"
        ),
        "{}",
        show(&out)
    );
    let err = stderr(&out);
    for says in [
        "base 'base': shared lock (--read): it is linked to the build cache",
        "locking base 'tools' exclusively (--read-exclusive): it is not linked",
        "and no mount namespace can be made here",
        "image 'app_stage0': exclusive lock (--write): ch-image keeps each earlier stage",
        "image 'app': exclusive lock (--write): the image this build makes",
    ] {
        assert!(err.contains(says), "{says}: {err}");
    }
    // Nothing ran.
    assert!(!ch.img("app").exists() && !ch.img("app_stage0").exists());
}

/// A store-wide command (here `ch-image build-cache --gc`, which needs the
/// whole storage) waits for the builds at work, and builds started while it
/// waits or runs wait for it: it never runs beside an image user.
#[test]
fn a_store_wide_command_is_queued_among_builds() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    let first = ch.build("app-a", "a");
    ch.wait_started("app-a", "a");

    let ran = ch.env.tmp.path().join("store-wide-ran");
    let storage = ch.storage.display().to_string();
    let script = format!(
        "test ! -e {img}/app-b && touch {ran} && exec ch-image -s {storage} --no-lock build-cache --gc",
        img = ch.storage.join("img").display(),
        ran = ran.display()
    );
    let wide = Bg::from_command(ch.stowage(["exec", "--store-wide", "--", "sh", "-c", &script]));
    // It waits for the build's locks, holding nothing they need.
    wait_until("the store-wide command waits for the build", || {
        ch.waiters("app-a").len() + ch.waiters("base").len() > 0
            || flock_waited_on(&ch.env.lock_file("app-a"))
            || flock_waited_on(&ch.env.lock_file("base"))
    });
    assert!(!ran.exists());

    // A build started now waits for the store-wide command.
    ch.dockerfile("Dockerfile", "FROM base\nRUN echo b > /b\n");
    let second = Bg::from_command(ch.ch_build(["-t", "app-b"]));
    let store_lock = ch.env.root.join("locks/store.lock");
    wait_until("the second build waits for the store", || {
        flock_waited_on(&store_lock)
    });
    assert!(!ch.img("app-b").exists());

    ch.go("app-a", "a");
    assert_ok(first.finish());
    assert_ok(wide.finish());
    assert!(ran.exists());
    let out = second.finish();
    assert_ok_ref(&out);
    assert!(
        stderr(&out).contains("waiting for the store-wide command to finish"),
        "{}",
        show(&out)
    );
    assert_eq!(ch.file("app-b", "b"), "b");
    assert_eq!(ch.ch_list(), ch.stowage_list());
}

/// The first example of `stowage exec --help`, run literally three times at
/// once for three tags (with the base it names imported and linked): all
/// succeed. With ch-image's own storage lock, two of three failed ("storage
/// directory is already in use").
#[test]
fn the_exec_help_example_works_in_parallel() {
    let Some(ch) = Ch::new() else { return };
    let help = output(ch.stowage(["exec", "--help"]));
    let text = String::from_utf8_lossy(&help.stdout).replace("\\\n", " ");
    let line = text
        .lines()
        .find(|l| l.contains("--read alpine:3.17"))
        .expect("the example");
    let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
    assert_eq!(words[0], "stowage");
    assert!(words.iter().any(|w| w == "app"), "{line}");
    let storage = ch.storage.display().to_string();
    let tarball = ch.env.tmp.path().join("base.tar").display().to_string();
    assert_ok(output(ch.stowage([
        "exec",
        "--store-wide",
        "--",
        bin(),
        "exec",
        "--write",
        "alpine:3.17",
        "--",
        "ch-image",
        "-s",
        &storage,
        "--no-lock",
        "import",
        &tarball,
        "alpine:3.17",
    ])));
    ch.dockerfile(
        "Dockerfile",
        "FROM alpine:3.17\nRUN sleep 1; echo app > /app\n",
    );
    let runs: Vec<Bg> = (0..3)
        .map(|i| {
            let mut c = ch.command(bin());
            c.arg("--root").arg(&ch.env.root);
            for w in &words[1..] {
                c.arg(if w == "app" {
                    format!("app{i}")
                } else {
                    w.clone()
                });
            }
            c.current_dir(&ch.ctx);
            Bg::from_command(c)
        })
        .collect();
    for r in runs {
        assert_ok(r.finish());
    }
    for i in 0..3 {
        assert_eq!(ch.file(&format!("app{i}"), "app"), "app");
    }
}

/// `ch-image delete X` also deletes X_stageN: ch-delete locks every image
/// ch-image will delete, waits for their users, and stowage forgets them.
#[test]
fn ch_delete_locks_and_forgets_the_stage_images() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    let df = ch.dockerfile(
        "Dockerfile.multi",
        "FROM base AS one\nRUN echo one > /one\nFROM base\nRUN echo two > /two\n",
    );
    assert_ok(output(ch.ch_build(["-t", "multi", "-f", &df])));
    assert_eq!(ch.stowage_list(), ["base", "multi", "multi_stage0"]);

    // A reader of the stage image holds the delete back.
    let mut hold = ch.stowage(["exec", "--read", "multi_stage0", "--"]);
    hold.args(ch.env.hold_cmd("held", "release"));
    let reader = Bg::from_command(hold);
    wait_for_file(&ch.env.sentinel("held"));
    let mut delete = ch.command(CH_DELETE);
    delete.arg("multi");
    let delete = Bg::from_command(delete);
    ch.env.wait_for_waiter("multi_stage0");
    assert!(
        ch.img("multi_stage0/one").is_file(),
        "deleted under a reader"
    );
    assert!(
        ch.img("multi/two").is_file(),
        "deleted while a stage was read"
    );
    ch.env.release("release");
    assert_ok(reader.finish());
    assert_ok(delete.finish());
    assert_eq!(ch.stowage_list(), ["base"]);
    assert_eq!(ch.ch_list(), ["base"]);
    let out = output(ch.stowage(["exec", "--read", "multi_stage0", "--", "true"]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
}

/// A base locked exclusively (not linked to the build cache) counts as used
/// by the builds from it: gc --unused-for does not offer it.
#[test]
fn a_base_locked_exclusively_records_its_use() {
    let Some(ch) = Ch::new() else { return };
    ch.no_namespaces();
    let df = ch.dockerfile("Dockerfile.mid", "FROM base\nRUN echo mid > /which\n");
    let mut c = ch.ch_build(["-t", "mid", "-f", &df]);
    c.env("STOWAGE_NOW", "2026-01-01T00:00:00Z");
    assert_ok(output(c));
    let df = ch.dockerfile("Dockerfile.app", "FROM mid\nRUN true\n");
    let out = output(ch.ch_build(["-t", "app", "-f", &df]));
    assert_ok_ref(&out);
    assert!(
        stderr(&out).contains("locking base 'mid' exclusively"),
        "{}",
        show(&out)
    );
    let mid = ch.env.image("mid").unwrap();
    assert!(
        mid["last_used"].as_str().unwrap() > "2026-06-01",
        "the build from mid is its last use: {mid}"
    );
    let out = ch.env.ok(["gc", "--unused-for", "1d", "--dry-run"]);
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert!(!said.contains("mid"), "gc offers a base just used: {said}");
    assert_eq!(ch.env.state("mid").as_deref(), Some("ready"));
}

/// A base built with --cache is linked to the build cache, so builds FROM
/// it read it together (shared lock) and leave it untouched.
#[test]
fn builds_from_a_cache_built_base_share_it() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    let df = ch.dockerfile("Dockerfile.mid", "FROM base\nRUN echo mid > /which\n");
    assert_ok(output(ch.ch_build(["--cache", "-t", "mid", "-f", &df])));
    assert!(ch.img("mid/.git").exists());
    let before = snapshot(&ch.img("mid"));

    const N: usize = 4;
    build_in_parallel_from(&ch, "mid", N);
    for i in 0..N {
        assert_eq!(ch.file(&format!("app{i}"), "which"), "mid");
    }
    assert_eq!(snapshot(&ch.img("mid")), before, "a build wrote its base");
}

/// A base built with --no-cache has no build-cache link, and every FROM of
/// it rewrites its ch/metadata.json and ch/environment (truncate, then
/// write). Builds FROM it read it together all the same: each runs in a
/// mount namespace where the base's ch/ is a private copy, so the base on
/// disk is never written, and each result carries the base's ENV.
#[test]
fn builds_from_a_base_without_a_cache_link_share_it() {
    let Some(ch) = Ch::new() else { return };
    if !ch.private_ch_works() {
        eprintln!("skipping: no mount namespace with a tmpfs can be made here");
        return;
    }
    let df = ch.dockerfile(
        "Dockerfile.mid",
        "FROM base\nENV MIDVAR=mid\nRUN echo mid > /which\n",
    );
    assert_ok(output(ch.ch_build(["-t", "mid", "-f", &df])));
    assert!(!ch.img("mid/.git").exists());
    let before = snapshot(&ch.img("mid"));

    const N: usize = 4;
    build_in_parallel_from(&ch, "mid", N);
    for i in 0..N {
        let app = format!("app{i}");
        assert_eq!(ch.file(&app, "which"), "mid");
        assert_eq!(ch.file(&app, "ch/environment"), "MIDVAR=mid");
        let md: Value = serde_json::from_str(&ch.file(&app, "ch/metadata.json")).unwrap();
        assert_eq!(md["env"]["MIDVAR"], "mid", "{md}");
    }
    assert_eq!(snapshot(&ch.img("mid")), before, "a build wrote its base");
    assert_eq!(ch.env.state("mid").as_deref(), Some("ready"));
    // Nothing of the namespaces outlives the builds.
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains("ch-build-private"), "{mounts}");
    // The results are images like any other: listed, and bases in turn.
    assert!(ch.ch_list().contains(&"app0".to_owned()));
    let df = ch.dockerfile("Dockerfile.top", "FROM app0\nRUN echo top > /top\n");
    assert_ok(output(ch.ch_build(["-t", "top", "-f", &df])));
    assert_eq!(ch.file("top", "which"), "mid");
    assert_eq!(ch.file("top", "ch/environment"), "MIDVAR=mid");

    // A failed build FROM it leaves its own tag incomplete, never the base.
    let bad = ch.dockerfile("Dockerfile.bad", "FROM mid\nRUN false\n");
    let out = output(ch.ch_build(["-t", "bad", "-f", &bad]));
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(ch.env.state("bad").as_deref(), Some("incomplete"));
    assert_eq!(ch.env.state("mid").as_deref(), Some("ready"));
    assert_eq!(
        snapshot(&ch.img("mid")),
        before,
        "a failed build wrote its base"
    );
}

/// A build whose Dockerfile is only `FROM mid` keeps, as its metadata, the
/// copy of mid's ch/ it made. Many at once (mid read shared) must each copy
/// it whole: none may copy it while another build has it truncated.
#[test]
fn from_only_builds_at_once_copy_their_base_whole() {
    let Some(ch) = Ch::new() else { return };
    if !ch.private_ch_works() {
        eprintln!("skipping: no mount namespace with a tmpfs can be made here");
        return;
    }
    let df = ch.dockerfile("Dockerfile.mid", "FROM base\nENV MIDVAR=mid\nRUN true\n");
    assert_ok(output(ch.ch_build(["-t", "mid", "-f", &df])));
    let want_md = fs::read(ch.img("mid/ch/metadata.json")).unwrap();
    let want_env = fs::read(ch.img("mid/ch/environment")).unwrap();
    let df = ch.dockerfile("Dockerfile.copy", "FROM mid\n");
    for round in 0..3 {
        let builds: Vec<Bg> = (0..6)
            .map(|i| Bg::from_command(ch.ch_build(["-t", &format!("copy{i}"), "-f", &df])))
            .collect();
        for b in builds {
            assert_ok(b.finish());
        }
        for i in 0..6 {
            let copy = ch.img(&format!("copy{i}"));
            assert_eq!(
                fs::read(copy.join("ch/metadata.json")).unwrap(),
                want_md,
                "copy{i}, round {round}"
            );
            assert_eq!(
                fs::read(copy.join("ch/environment")).unwrap(),
                want_env,
                "copy{i}, round {round}"
            );
        }
    }
}

/// Every file under `dir` (but .git) with its content and mtime.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>, i64)> {
    use std::os::unix::fs::MetadataExt;
    let mut v: Vec<_> = tree(dir)
        .into_iter()
        .filter(|p| !p.starts_with(".git"))
        .filter_map(|p| {
            let full = dir.join(&p);
            let md = fs::symlink_metadata(&full).ok()?;
            md.is_file().then(|| {
                (
                    p.clone(),
                    fs::read(&full).unwrap(),
                    md.mtime_nsec() + md.mtime() * 1_000_000_000,
                )
            })
        })
        .collect();
    v.sort();
    v
}

/// base → mid → app launched at once, app first: app waits for mid to be
/// started and then for it to be finished, and builds from it.
#[test]
fn a_dependency_chain_launched_at_once_builds() {
    let Some(ch) = Ch::new() else { return };
    let app_df = ch.dockerfile("Dockerfile.app", "FROM mid\nRUN echo app > /app\n");
    let app = Bg::from_command(ch.ch_build(["--wait", "60", "-t", "app", "-f", &app_df]));
    // mid's build holds at its RUN step until released.
    ch.dockerfile(
        "Dockerfile",
        &gated("base").replace("ARG ID", "ARG ID\nRUN echo mid > /which"),
    );
    let mid = ch.build("mid", "m");
    ch.wait_started("mid", "m");
    ch.env.wait_for_waiter("mid");
    assert!(!ch.img("app").exists());
    ch.go("mid", "m");
    assert_ok(mid.finish());
    let out = app.finish();
    assert_ok_ref(&out);
    assert_eq!(ch.file("app", "which"), "mid");
    assert_eq!(ch.file("app", "app"), "app");

    // Without --wait a missing base is refused at once (66), as before.
    let df = ch.dockerfile("Dockerfile.x", "FROM later\nRUN true\n");
    let out = output(ch.ch_build(["-t", "x", "-f", &df]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    // With a bound, it gives up after the bound.
    let out = output(ch.ch_build(["--wait", "0.3", "-t", "x", "-f", &df]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    assert!(
        stderr(&out).contains("or start its build within --wait 0.3"),
        "{}",
        show(&out)
    );
    // A signal ends a ch-build that waits for its base to be started.
    let log = ch.env.tmp.path().join("waiting.log");
    let mut c = ch.ch_build(["--wait", "600", "-t", "x", "-f", &df]);
    c.stderr(fs::File::create(&log).unwrap());
    let waiting = Bg::from_command_keep_stderr(c);
    wait_until("ch-build waits for 'later' to be started", || {
        fs::read_to_string(&log).is_ok_and(|l| l.contains("waits for base 'later'"))
    });
    waiting.signal(libc::SIGTERM);
    let out = waiting.finish();
    assert_eq!(out.status.code(), Some(143), "{}", show(&out));
    assert!(!ch.img("x").exists());
}

/// ch-build reads the Dockerfile once: the locks it plans are those of the
/// build that runs. A build queued behind another build of its tag runs
/// the Dockerfile as it was planned, not as it was edited while it waited
/// (before, it ran the edit: here a new stage, written as `app_stage0`
/// with no lock and no record).
#[test]
fn a_build_runs_the_dockerfile_it_planned() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    let first = ch.build("app", "first");
    ch.wait_started("app", "first");
    let df = ch.dockerfile("Dockerfile.2", "FROM base\nRUN echo planned > /v\n");
    let second = Bg::from_command(ch.ch_build(["-t", "app", "-f", &df]));
    ch.env.wait_for_waiter("app");
    ch.dockerfile(
        "Dockerfile.2",
        "FROM base AS s\nRUN true\nFROM base\nRUN echo edited > /v\n",
    );
    ch.go("app", "first");
    assert_ok(first.finish());
    assert_ok(second.finish());
    assert_eq!(ch.file("app", "v"), "planned");
    assert!(!ch.img("app_stage0").exists());
    assert_eq!(ch.stowage_list(), ["app", "base"]);
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
}

/// A Dockerfile on a pipe (`-f -`, `-f /dev/stdin`, `-f <(...)`), which
/// plain ch-image takes, is read once, whole, for the plan and the build
/// alike: before, ch-plan used the pipe up and ch-image read it empty under
/// the locks, leaving a ready image `incomplete` and a new tag a record
/// with no directory (`-f -` was refused). A refusal names the file as
/// given.
#[test]
fn a_dockerfile_on_a_pipe_is_read_once() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", "FROM base\nRUN echo first > /id\n");
    assert_ok(output(ch.ch_build(["-t", "ps1"])));
    let piped = |text: &str, args: &str| {
        let mut c = ch.command("sh");
        c.args([
            "-c",
            &format!("printf '{text}' | \"$0\" {args} \"$1\""),
            CH_BUILD,
        ])
        .arg(&ch.ctx);
        output(c)
    };
    assert_ok(piped(
        "FROM base\\nRUN echo piped > /id\\n",
        "-t ps1 -f /dev/stdin",
    ));
    assert_eq!(ch.file("ps1", "id"), "piped");
    assert_eq!(ch.env.state("ps1").as_deref(), Some("ready"));
    assert_ok(piped("FROM base\\nRUN echo new > /id\\n", "-t psn -f -"));
    assert_eq!(ch.file("psn", "id"), "new");
    let out = piped("FROM base\\nBOGUS x\\n", "-t psbad -f -");
    assert_eq!(out.status.code(), Some(64), "{}", show(&out));
    assert!(stderr(&out).contains("can't parse: -:"), "{}", show(&out));
    assert_eq!(ch.env.state("psbad"), None);
}

/// A chain's base whose build ends before it makes the base's directory
/// (stopped just after taking its lock) is recorded incomplete, with
/// nobody holding it: the dependent build waiting for it to start says at
/// once that it is not ready (66), instead of waiting its whole --wait and
/// then advising an import. An incomplete record there before the wait
/// began is an earlier failure: a chain launched again still waits for the
/// base's new build.
#[test]
fn a_chain_ends_at_once_when_its_base_build_stops_before_making_it() {
    let Some(ch) = Ch::new() else { return };
    let app_df = ch.dockerfile("Dockerfile.app", "FROM mid\nRUN echo app > /app\n");
    let flag = ch.env.tmp.path().join("held");
    let go = ch.env.tmp.path().join("go");
    // mid's "build": takes mid's lock, is stopped before a directory is made.
    let script = format!(
        "rmdir \"$STOWAGE_IMAGE_DIR\" && touch '{}' && i=0 && \
         while [ ! -e '{}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; exit 1",
        flag.display(),
        go.display()
    );
    let mid = Bg::from_command(ch.stowage(["exec", "--write", "mid", "--", "sh", "-c", &script]));
    wait_for_file(&flag);
    let waiting = |name: &str| {
        let log = ch.env.tmp.path().join(name);
        let mut c = ch.ch_build(["--wait", "20", "-t", "app", "-f", &app_df]);
        c.stderr(fs::File::create(&log).unwrap());
        let app = Bg::from_command_keep_stderr(c);
        wait_until("ch-build waits for 'mid' to be started", || {
            fs::read_to_string(&log).is_ok_and(|l| l.contains("waits for base 'mid'"))
        });
        (app, log)
    };
    let (app, log) = waiting("app1.log");
    fs::write(&go, "").unwrap();
    assert_eq!(mid.finish().status.code(), Some(1));
    assert_eq!(ch.env.state("mid").as_deref(), Some("incomplete"));
    let out = app.finish();
    let said = fs::read_to_string(&log).unwrap();
    assert_eq!(out.status.code(), Some(66), "{said}");
    assert!(
        said.contains("not ready (state: incomplete, its writer"),
        "{said}"
    );
    assert!(!said.contains("import or pull it first"), "{said}");
    assert!(!ch.img("app").exists());

    // Launched again, the chain waits for mid's new build.
    let (app, _) = waiting("app2.log");
    ch.dockerfile("Dockerfile", &gated("base"));
    let mid = ch.build("mid", "m2");
    ch.wait_started("mid", "m2");
    ch.go("mid", "m2");
    assert_ok(mid.finish());
    assert_ok(app.finish());
    assert_eq!(ch.file("app", "app"), "app");
}

/// A cache-mode import (it renames through STORAGE/imgtmp, which no other
/// ch-image command may see) runs under --store-wide while builds come and
/// go, recorded by an exec --write inside the hold: builds then read the
/// image shared.
#[test]
fn a_cache_mode_import_runs_store_wide() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    let before = ch.build("app-a", "a");
    ch.wait_started("app-a", "a");
    let storage = ch.storage.display().to_string();
    let tarball = ch.env.tmp.path().join("base.tar").display().to_string();
    let import = Bg::from_command(ch.stowage([
        "exec",
        "--no-inherit",
        "--store-wide",
        "--",
        bin(),
        "exec",
        "--write",
        "base2",
        "--",
        "ch-image",
        "-s",
        &storage,
        "--no-lock",
        "import",
        &tarball,
        "base2",
    ]));
    wait_until("the import waits for the build", || {
        flock_waited_on(&ch.env.lock_file("app-a")) || flock_waited_on(&ch.env.lock_file("base"))
    });
    assert!(!ch.img("base2").exists());
    ch.go("app-a", "a");
    assert_ok(before.finish());
    assert_ok(import.finish());
    assert!(ch.img("base2/.git").exists());
    assert_eq!(ch.env.state("base2").as_deref(), Some("ready"));
    let df = ch.dockerfile("Dockerfile.b2", "FROM base2\nRUN echo b2 > /b2\n");
    let plan = dry_run(&ch, &["-t", "app-b", "-f", &df, ch.ctx.to_str().unwrap()]);
    assert!(plan.contains("--read base2 --write app-b"), "{plan}");
    assert_ok(output(ch.ch_build(["-t", "app-b", "-f", &df])));
    assert_eq!(ch.ch_list(), ch.stowage_list());
}

/// `ch-image build-cache --reset` deletes the images linked to the cache
/// (here `base`). Run store-wide, it leaves stowage's records true: the
/// deleted image is gone from `stowage images` too, and builds from it are
/// refused (66) rather than sent to a registry.
#[test]
fn a_build_cache_reset_store_wide_keeps_the_records_true() {
    let Some(ch) = Ch::new() else { return };
    derived(&ch, "app", "base");
    let out = ch_image_store_wide(&ch, &["build-cache", "--reset"]);
    assert_ok_ref(&out);
    assert!(
        !ch.img("base").exists(),
        "ch-image no longer deletes linked images?"
    );
    assert!(
        stderr(&out).contains("image 'base' was deleted by the store-wide command"),
        "{}",
        show(&out)
    );
    assert_eq!(ch.stowage_list(), ch.ch_list());
    assert_eq!(ch.stowage_list(), ["app"]);
    let df = ch.dockerfile("Dockerfile.x", "FROM base\nRUN true\n");
    let out = output(ch.ch_build(["-t", "x", "-f", &df]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
}

/// A copy (`exec --from`) of a base linked to the build cache leaves out
/// the base's `/.git` (its git worktree's link), as ch-image's own copy
/// does: with it, the copy claimed the base's worktree, and every later
/// cache-mode command (list, build, delete) failed on ch-image's check.
#[test]
fn a_copy_of_a_cache_linked_base_leaves_the_build_cache_whole() {
    let Some(ch) = Ch::new() else { return };
    assert!(ch.img("base/.git").is_file(), "base is linked to the cache");
    let out = output(ch.stowage(["exec", "--write", "app", "--from", "base", "--", "true"]));
    assert_ok_ref(&out);
    assert!(!ch.img("app/.git").exists());
    assert!(ch.img("app/bin/busybox").is_file());
    assert_ok(output(ch.ch_image(["--no-lock", "list"])));
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    let df = ch.dockerfile("Dockerfile.c1", "FROM base\nRUN echo c1 > /which\n");
    assert_ok(output(ch.ch_build(["--cache", "-t", "c1", "-f", &df])));
    let mut delete = ch.command(CH_DELETE);
    delete.arg("app");
    assert_ok(output(delete));
}

/// ch-image writes the storage path it is given into every linked image's
/// .git, and a cache-mode command given another spelling rewrites them
/// all, holding none of their locks. The wrappers give it one spelling,
/// the real path, however CH_IMAGE_STORAGE names the storage: a --cache
/// build and a delete through a symlinked name leave base/.git as it was
/// (before, both rewrote it to the symlink's spelling).
#[test]
fn the_wrappers_give_ch_image_one_spelling_of_the_storage() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    let link = ch.env.tmp.path().join("storage-link");
    std::os::unix::fs::symlink(&ch.storage, &link).unwrap();
    let git = ch.img("base/.git");
    let before = (
        fs::read(&git).unwrap(),
        fs::metadata(&git).unwrap().modified().unwrap(),
    );
    let df = ch.dockerfile("Dockerfile.c", "FROM base\nRUN echo c > /which\n");
    let mut build = ch.ch_build(["--cache", "-t", "viasym", "-f", &df]);
    build.env("CH_IMAGE_STORAGE", &link);
    assert_ok(output(build));
    assert_eq!(ch.file("viasym", "which"), "c");
    let mut delete = ch.command(CH_DELETE);
    delete.env("CH_IMAGE_STORAGE", &link).arg("viasym");
    assert_ok(output(delete));
    assert!(!ch.img("viasym").exists());
    let after = (
        fs::read(&git).unwrap(),
        fs::metadata(&git).unwrap().modified().unwrap(),
    );
    assert_eq!(
        String::from_utf8_lossy(&after.0),
        String::from_utf8_lossy(&before.0)
    );
    assert_eq!(after.1, before.1, "base/.git was written");
}

/// An image stowage records without a directory (its build stopped before
/// ch-image made it) is one ch-image cannot see: ch-delete says so and
/// names the `stowage rm` that removes it, which then works.
#[test]
fn ch_delete_names_what_only_stowage_records() {
    let Some(ch) = Ch::new() else { return };
    let script = "rmdir \"$STOWAGE_IMAGE_DIR\"; exit 1";
    let out = output(ch.stowage(["exec", "--write", "ek", "--", "sh", "-c", script]));
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert_eq!(ch.stowage_list(), ["base", "ek"]);
    let mut delete = ch.command(CH_DELETE);
    delete.arg("ek");
    let out = output(delete);
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    let said = stderr(&out);
    let fix = said
        .split("remove with '")
        .nth(1)
        .and_then(|r| r.split('\'').next());
    let fix = fix.unwrap_or_else(|| panic!("no command named: {said}"));
    let mut rm = ch.command("sh");
    rm.args(["-c", fix]);
    assert_ok(output(rm));
    assert_eq!(ch.stowage_list(), ["base"]);
}

/// ch-image refuses a storage directory holding `imgtmp`, which a
/// cache-mode import makes while it runs under `--store-wide`: ch-build and
/// ch-delete started meanwhile wait for it and then go on (before, each
/// failed at once); an `imgtmp` left by a stopped import is named, with
/// what to remove.
#[test]
fn wrappers_started_during_a_store_wide_import_wait_for_it() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN echo b > /b\n");
    assert_ok(output(ch.ch_build(["-t", "old"])));
    let imgtmp = ch.storage.join("imgtmp");
    let script = format!(
        "mkdir {t} && touch {held} && while [ ! -e {go} ]; do sleep 0.05; done; rmdir {t}",
        t = imgtmp.display(),
        held = ch.env.sentinel("held").display(),
        go = ch.env.sentinel("go").display()
    );
    let wide = Bg::from_command(ch.stowage(["exec", "--store-wide", "--", "sh", "-c", &script]));
    wait_for_file(&ch.env.sentinel("held"));
    let (build_log, delete_log) = (ch.env.sentinel("build.log"), ch.env.sentinel("delete.log"));
    let mut build = ch.ch_build(["-t", "app"]);
    build.stderr(fs::File::create(&build_log).unwrap());
    let build = Bg::from_command_keep_stderr(build);
    let mut delete = ch.command(CH_DELETE);
    delete
        .arg("old")
        .stderr(fs::File::create(&delete_log).unwrap());
    let delete = Bg::from_command_keep_stderr(delete);
    let waiting = |log: &Path| {
        fs::read_to_string(log).is_ok_and(|l| l.contains("waiting for the store-wide command"))
    };
    wait_until("both wrappers wait for the import", || {
        waiting(&build_log) && waiting(&delete_log)
    });
    fs::write(ch.env.sentinel("go"), "").unwrap();
    assert_ok(wide.finish());
    let out = build.finish();
    let said = fs::read_to_string(&build_log).unwrap();
    assert_eq!(out.status.code(), Some(0), "{}{said}", show(&out));
    assert!(said.contains("imgtmp"), "{said}");
    let out = delete.finish();
    let said = fs::read_to_string(&delete_log).unwrap();
    assert_eq!(out.status.code(), Some(0), "{}{said}", show(&out));
    assert_eq!(ch.file("app", "b"), "b");
    assert!(!ch.img("old").exists());

    fs::create_dir(&imgtmp).unwrap();
    let out = output(ch.ch_build(["-t", "app2"]));
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(stderr(&out).contains("rm -rf"), "{}", show(&out));
    assert!(!ch.img("app2").exists());
}

/// One --wait bounds all of a wrapper's waiting: the wait for a store-wide
/// import and the locks' after it draw on one deadline. Every stowage that
/// ch-build and ch-delete run is logged by a `stowage` found first on PATH;
/// with the import held 3 s of a 60 s --wait, the exec that takes the
/// locks is given 57 s at most (before, a full 60 s anew).
#[test]
fn a_wrappers_wait_bounds_an_import_and_the_locks_together() {
    use std::os::unix::fs::PermissionsExt;
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN echo b > /b\n");
    assert_ok(output(ch.ch_build(["-t", "old"])));
    let shim_dir = ch.env.sentinel("shim");
    fs::create_dir(&shim_dir).unwrap();
    let log = ch.env.sentinel("calls.log");
    let shim = shim_dir.join("stowage");
    fs::write(
        &shim,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{}'\nexec '{}' \"$@\"\n",
            log.display(),
            bin()
        ),
    )
    .unwrap();
    fs::set_permissions(&shim, fs::Permissions::from_mode(0o755)).unwrap();
    let script = format!(
        "mkdir {t} && touch {held} && while [ ! -e {go} ]; do sleep 0.05; done; rmdir {t}",
        t = ch.storage.join("imgtmp").display(),
        held = ch.env.sentinel("held").display(),
        go = ch.env.sentinel("go").display()
    );
    let wide = Bg::from_command(ch.stowage(["exec", "--store-wide", "--", "sh", "-c", &script]));
    wait_for_file(&ch.env.sentinel("held"));
    let logs = [ch.env.sentinel("build.log"), ch.env.sentinel("delete.log")];
    let mut delete = ch.command(CH_DELETE);
    delete.args(["--wait", "60", "old"]);
    let [build, delete] = [ch.ch_build(["--wait", "60", "-t", "app"]), delete];
    let [build, delete] = [(build, &logs[0]), (delete, &logs[1])].map(|(mut c, l)| {
        // The stowage the wrapper runs is the shim, found first on its PATH.
        let path = c
            .get_envs()
            .find(|(k, _)| *k == "PATH")
            .and_then(|(_, v)| v);
        let path = path.unwrap().to_string_lossy().into_owned();
        c.env("PATH", format!("{}:{path}", shim_dir.display()));
        c.stderr(fs::File::create(l).unwrap());
        Bg::from_command_keep_stderr(c)
    });
    let waiting =
        |l: &Path| fs::read_to_string(l).is_ok_and(|t| t.contains("waiting for the store-wide"));
    wait_until("both wrappers wait for the import", || {
        logs.iter().all(|l| waiting(l))
    });
    std::thread::sleep(std::time::Duration::from_secs(3));
    fs::write(ch.env.sentinel("go"), "").unwrap();
    assert_ok(wide.finish());
    for (bg, l) in [(build, &logs[0]), (delete, &logs[1])] {
        let out = bg.finish();
        let said = fs::read_to_string(l).unwrap();
        assert_eq!(out.status.code(), Some(0), "{}{said}", show(&out));
    }
    let calls = fs::read_to_string(&log).unwrap();
    let given: Vec<f64> = calls
        .lines()
        .filter(|l| l.contains(" --write "))
        .filter_map(|l| l.split("--wait ").nth(1))
        .map(|w| w.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(given.len(), 2, "{calls}");
    assert!(given.iter().all(|w| *w <= 57.0), "{calls}");
}

/// After a store-wide import ends, a network filesystem's client may still
/// show its `imgtmp` for a second from its name cache (GlusterFS's FUSE
/// client, after the import's host crashed): ch-build looks again once that
/// second is past, within --wait, and builds. Here the directory goes a
/// moment after the hold ends, as a cached name does; before, ch-build
/// looked at once, refused (exit 1) and named an `rm -rf` of a directory
/// that was gone.
#[test]
fn a_wrapper_looks_again_at_an_imgtmp_a_name_cache_may_still_show() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", "FROM base\nRUN echo b > /b\n");
    let imgtmp = ch.storage.join("imgtmp");
    fs::create_dir(&imgtmp).unwrap();
    let script = format!(
        "touch {held} && while [ ! -e {go} ]; do sleep 0.05; done",
        held = ch.env.sentinel("held").display(),
        go = ch.env.sentinel("go").display()
    );
    let wide = Bg::from_command(ch.stowage(["exec", "--store-wide", "--", "sh", "-c", &script]));
    wait_for_file(&ch.env.sentinel("held"));
    let log = ch.env.sentinel("build.log");
    let mut build = ch.ch_build(["--wait", "60", "-t", "app"]);
    build.stderr(fs::File::create(&log).unwrap());
    let build = Bg::from_command_keep_stderr(build);
    wait_until("ch-build waits for the import", || {
        fs::read_to_string(&log).is_ok_and(|l| l.contains("waiting for the store-wide command"))
    });
    fs::write(ch.env.sentinel("go"), "").unwrap();
    assert_ok(wide.finish());
    // Seen a moment longer than the hold, as through a name cache.
    std::thread::sleep(std::time::Duration::from_millis(300));
    fs::remove_dir(&imgtmp).unwrap();
    let out = build.finish();
    let said = fs::read_to_string(&log).unwrap();
    assert_eq!(out.status.code(), Some(0), "{}{said}", show(&out));
    assert!(!said.contains("rm -rf"), "{said}");
    assert_eq!(ch.file("app", "b"), "b");
}

/// A FIFO planted at a lock file blocks no wrapper: ch-build FROM a base
/// whose lock is a FIFO, and ch-build and ch-delete facing an `imgtmp` with
/// a FIFO at `locks/store.lock`, each refuse in one line naming the FIFO
/// (before, each hung for good in flock(1)'s open, whatever --wait said).
/// A hang fails the test: each run is bounded.
#[test]
fn wrappers_refuse_a_fifo_at_a_lock_file_without_blocking() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN echo b > /b\n");
    assert_ok(output(ch.ch_build(["-t", "old"])));
    let bounded = |c: Command| {
        let bg = Bg::from_command(c);
        wait_output(bg_child(bg), std::time::Duration::from_secs(30))
    };
    let fifo = |p: &Path| {
        let _ = fs::remove_file(p);
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(
            unsafe { libc::mkfifo(c.as_ptr(), 0o644) },
            0,
            "mkfifo {}",
            p.display()
        );
    };
    let base_lock = ch.env.root.join("locks/images/base.lock");
    fifo(&base_lock);
    let out = bounded(ch.ch_build(["--wait", "5", "-t", "app"]));
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let said = stderr(&out);
    assert!(
        said.contains(&format!("{} is a FIFO", base_lock.display())),
        "{}",
        show(&out)
    );
    assert_eq!(said.lines().count(), 1, "{}", show(&out));
    fs::remove_file(&base_lock).unwrap();

    let store_lock = ch.env.root.join("locks/store.lock");
    fifo(&store_lock);
    fs::create_dir(ch.storage.join("imgtmp")).unwrap();
    let mut delete = ch.command(CH_DELETE);
    delete.args(["--wait", "5", "old"]);
    for c in [ch.ch_build(["--wait", "5", "-t", "app"]), delete] {
        let out = bounded(c);
        assert_eq!(out.status.code(), Some(1), "{}", show(&out));
        let said = stderr(&out);
        assert!(
            said.contains(&format!("{} is a FIFO", store_lock.display())),
            "{}",
            show(&out)
        );
        assert_eq!(said.lines().count(), 1, "{}", show(&out));
    }
    assert!(ch.img("old").exists());
    assert!(!ch.img("app").exists());
}

/// The child of a background command, to wait for with a bound of one's own.
fn bg_child(mut bg: Bg) -> std::process::Child {
    bg.child.take().unwrap()
}

/// ch-delete of an image whose path under img/ is a symlink (planted
/// there) refuses, saying it is a delete that it refuses (before, stowage's
/// refusal spoke of a build), and follows it nowhere.
#[test]
fn ch_delete_refuses_a_symlink_at_an_image_path_as_a_delete() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    let v = victim(&ch.env);
    std::os::unix::fs::symlink(&v, ch.img("vt")).unwrap();
    let mut delete = ch.command(CH_DELETE);
    delete.arg("vt");
    let out = output(delete);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let said = stderr(&out);
    assert!(
        said.contains("refusing to delete through it"),
        "{}",
        show(&out)
    );
    assert!(!said.contains("build"), "{}", show(&out));
    assert_eq!(said.lines().count(), 1, "{}", show(&out));
    assert_intact(&v);
    assert!(ch.img("vt").is_symlink());
}

/// A build that fails while the lookup of its image's directory fails with
/// ENOTCONN (a GlusterFS client reconnecting; injected here by strace) is
/// not said to have left no directory: ch-build says it cannot tell, and
/// names no `stowage rm` (before, a failed `[ -e ]` read as "no directory").
#[test]
fn ch_build_does_not_read_a_lookup_that_failed_as_no_directory() {
    if !tool_or_skip("strace", "strace") {
        return;
    }
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", "FROM base\nRUN false\n");
    let dir = ch.img("bad");
    let calls = "stat,lstat,newfstatat,statx";
    let mut c = ch.command("strace");
    c.args(["-f", "-qq", "-o", "/dev/null", "-P"])
        .arg(&dir)
        .arg(format!("-e trace={calls}").replace(' ', ""))
        .arg(format!("-e inject={calls}:error=ENOTCONN").replace(' ', ""))
        .arg(CH_BUILD)
        .args(["-t", "bad"])
        .arg(&ch.ctx);
    let out = output(c);
    assert_ne!(out.status.code(), Some(0), "{}", show(&out));
    let said = stderr(&out);
    let last = said.lines().last().unwrap_or_default();
    assert!(last.contains("cannot tell whether"), "{}", show(&out));
    assert!(
        last.contains("Transport endpoint is not connected"),
        "{}",
        show(&out)
    );
    assert!(!last.contains("stowage rm"), "{}", show(&out));
}

/// The wrappers take `--option=value` as `--option value`, as stowage does.
#[test]
fn wrappers_take_options_with_an_equals_sign() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", "FROM base\nARG A\n");
    let ctx = ch.ctx.to_str().unwrap();
    let spaced = dry_run(
        &ch,
        &["-t", "app", "--wait", "10s", "--build-arg", "A=1", ctx],
    );
    let joined = dry_run(&ch, &["--tag=app", "--wait=10s", "--build-arg=A=1", ctx]);
    assert_eq!(joined, spaced);
    let mut delete = ch.command(CH_DELETE);
    delete.args(["--dry-run", "--wait=10s", "base"]);
    let out = output(delete);
    assert_ok_ref(&out);
    assert!(stdout(&out).contains("--wait 10s"), "{}", show(&out));
}

/// `ch-image reset` under `--store-wide` makes the storage directory, and
/// so the images directory, anew: stowage takes the new directory (same
/// filesystem, made while it held the whole store) for the one it records,
/// and forgets every image it no longer holds. Before, the records stayed
/// `ready` ("not the directory recorded"), and reads of gone trees ran.
#[test]
fn a_reset_store_wide_forgets_every_image_it_removed() {
    let Some(ch) = Ch::new() else { return };
    derived(&ch, "app", "base");
    let out = ch_image_store_wide(&ch, &["reset"]);
    assert_ok_ref(&out);
    assert!(!ch.img("base").exists() && !ch.img("app").exists());
    assert_eq!(ch.stowage_list(), Vec::<String>::new());
    let out = output(ch.stowage(["exec", "--read", "base", "--", "true"]));
    assert_eq!(out.status.code(), Some(66), "{}", show(&out));
    ch.env.ok(["doctor"]);
    ch.env.ok(["exec", "--write", "new", "--", "true"]);
    assert!(ch.img("new").is_dir());
}

/// `stowage exec --store-wide -- ch-image -s STORAGE --no-lock ARGS…`.
fn ch_image_store_wide(ch: &Ch, args: &[&str]) -> std::process::Output {
    let storage = ch.storage.display().to_string();
    let mut all = vec![
        "exec",
        "--no-inherit",
        "--store-wide",
        "--",
        "ch-image",
        "-s",
        &storage,
        "--no-lock",
    ];
    all.extend_from_slice(args);
    output(ch.stowage(all))
}

/// Every live process whose arguments contain all of `words`, with them.
fn processes_with(words: &[&str]) -> Vec<(u32, Vec<String>)> {
    processes_mentioning(words[0])
        .into_iter()
        .filter_map(|pid| {
            let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<String> = raw
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            words
                .iter()
                .all(|w| args.iter().any(|a| a.contains(w)))
                .then_some((pid, args))
        })
        .collect()
}
/// The ch-image (Python) process of the build whose build argument is
/// `ID=id`.
fn ch_image_of(id: &str) -> u32 {
    let arg = format!("ID={id}");
    let mut pid = None;
    wait_until("ch-image runs", || {
        pid = processes_with(&[&arg, "build"])
            .into_iter()
            .find(|(_, args)| args[0].contains("python"))
            .map(|(p, _)| p);
        pid.is_some()
    });
    pid.unwrap()
}
/// Whether process `pid` ignores signal `sig` (SigIgn in its status).
fn ignores(pid: u32, sig: i32) -> bool {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .unwrap_or(0);
    mask >> (sig - 1) & 1 == 1
}
/// ch-image killed alone (SIGKILL, as the OOM killer does, or SIGTERM, as
/// a kill by name does) ends the build: its RUN step, which ch-image starts
/// without the lock descriptors, is ended before ch-build exits, so no
/// process of the build writes once the locks are gone. Before, the RUN
/// step went on writing the image after ch-build had exited and another
/// writer held its lock.
#[test]
fn ch_image_killed_alone_leaves_no_process_of_the_build_behind_its_locks() {
    let Some(ch) = Ch::new() else { return };
    for (i, sig) in [libc::SIGKILL, libc::SIGTERM].into_iter().enumerate() {
        let tag = format!("orphan{i}");
        let id = format!("orphan{i}-4471");
        // The RUN step ignores SIGTERM, as a step that must not be cut
        // short may: only a SIGKILL after the grace ends it.
        ch.dockerfile(
            "Dockerfile",
            &format!(
                "FROM base\nARG ID\nRUN : run-{id}; trap '' TERM; touch /started; i=0; \
                 while [ $i -lt 1200 ]; do echo $i > /tick; sleep 0.05; i=$((i+1)); done\n"
            ),
        );
        // Its log in a file: a process left of the build would keep a
        // pipe open after ch-build's exit.
        let log = ch.env.tmp.path().join(format!("{tag}.log"));
        let mut c = ch.ch_build(["-t", &tag, "--build-arg", &format!("ID={id}")]);
        c.stderr(fs::File::create(&log).unwrap());
        let b = Bg::from_command_keep_stderr(c);
        wait_for_file(&ch.img(&tag).join("started"));
        let pid = ch_image_of(&id);
        unsafe { libc::kill(pid as i32, sig) };
        let out = b.finish();
        let err = fs::read_to_string(&log).unwrap();
        assert_eq!(out.status.code(), Some(128 + sig), "{err}");
        // No shell's own error about the ended build's /proc entry.
        assert!(!err.contains("/cmdline"), "{err}");
        // At ch-build's exit, nothing of the build is left to write.
        let left = processes_mentioning(&format!("run-{id}"));
        assert!(left.is_empty(), "the RUN step outlived ch-build: {left:?}");
        assert!(flock_free(&ch.env.lock_file(&tag)));
        assert_eq!(ch.env.state(&tag).as_deref(), Some("incomplete"));
        // The next writer holds the tree alone: it does not change under it.
        let tick = ch.img(&tag).join("tick");
        let before = fs::read(&tick).unwrap();
        let script = format!(
            "a=$(cat {t}); touch {held}; while [ ! -e {go} ]; do sleep 0.01; done; \
             [ \"$a\" = \"$(cat {t})\" ]",
            t = tick.display(),
            held = ch.env.sentinel(&format!("held{i}")).display(),
            go = ch.env.sentinel(&format!("go{i}")).display()
        );
        let mut next = ch.stowage(["exec", "--no-wait", "--write", &tag, "--"]);
        next.args(["sh", "-c", &script]);
        let next = Bg::from_command(next);
        wait_for_file(&ch.env.sentinel(&format!("held{i}")));
        fs::write(ch.env.sentinel(&format!("go{i}")), "").unwrap();
        assert_ok(next.finish());
        assert_eq!(fs::read(&tick).unwrap(), before);
    }
}
/// `ch-build --locked`, the command under the locks, takes a burst of
/// signals (a process-group SIGTERM reaches it directly and through stowage
/// at once) without an error in the log. Before, its trap handler ran a
/// command substitution, and bash 5.2 reported `unexpected EOF while
/// looking for matching ')'` when a second signal interrupted its parse.
#[test]
fn ch_build_locked_takes_a_burst_of_signals_without_an_error() {
    let env = Env::new();
    let go = env.sentinel("go");
    let started = env.sentinel("started");
    // A command that ignores the signals, so that the burst meets the
    // handlers, not the end of the build.
    let script = format!(
        "trap '' TERM HUP QUIT INT; touch {s}; while [ ! -e {g} ]; do sleep 0.01; done",
        s = started.display(),
        g = go.display()
    );
    let mut c = Command::new(CH_BUILD);
    c.args(["--locked", "-t", "burst", "--", "sh", "-c", &script])
        .env("CH_BUILD_STARTED", env.sentinel("build-started"));
    let b = Bg::from_command(c);
    wait_for_file(&started);
    for _ in 0..2000 {
        for sig in [libc::SIGTERM, libc::SIGHUP] {
            b.signal(sig);
        }
        std::thread::sleep(std::time::Duration::from_micros(500));
    }
    fs::write(&go, "").unwrap();
    let out = b.finish();
    let err = stderr(&out);
    assert!(!err.contains("unexpected EOF"), "{err}");
    assert!(err.trim().is_empty(), "{err}");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
}
/// `ch-delete GLOB` deletes exactly the images it locked. A build of a tag
/// that begins to match the glob once ch-delete has checked its set under
/// the locks is left alone. Before, ch-delete ran `ch-image delete GLOB`,
/// which globbed again as it started (here held at its start by a copy of
/// ch-image, as a slow Python start-up holds it) and deleted the new
/// build's tree under that build's exclusive lock.
#[test]
fn ch_delete_leaves_an_image_that_begins_to_match_once_its_set_is_checked() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile.old", "FROM base\nRUN echo old > /old\n");
    let df = ch.ctx.join("Dockerfile.old");
    assert_ok(output(ch.ch_build([
        "-t",
        "ci_old",
        "-f",
        df.to_str().unwrap(),
    ])));

    // A ch-image whose `delete` waits for a sentinel before it does anything.
    let shim = ch.env.tmp.path().join("shim");
    fs::create_dir_all(shim.join("bin")).unwrap();
    fs::create_dir_all(shim.join("lib")).unwrap();
    let which = output({
        let mut c = ch.command("sh");
        c.args(["-c", "command -v ch-image; command -v ch-run"]);
        c
    });
    let found = stdout(&which);
    let mut lines = found.lines();
    let (real, run) = (lines.next().unwrap(), lines.next().unwrap());
    let go = ch.env.sentinel("delete-go");
    let text = fs::read_to_string(real).unwrap().replacen(
        "def main():\n",
        &format!(
            "def main():\n   if \"delete\" in sys.argv and __name__ == \"__main__\":\n      \
             import time\n      \
             for _ in range(1200):\n         \
             if os.path.exists({go:?}): break\n         \
             time.sleep(0.05)\n",
            go = go.display().to_string()
        ),
        1,
    );
    assert!(text.contains("delete-go"), "ch-image has no main()");
    let lib = Path::new(real)
        .parent()
        .unwrap()
        .join("../lib/charliecloud");
    fs::write(shim.join("bin/ch-image"), text).unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(shim.join("bin/ch-image"), fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink(run, shim.join("bin/ch-run")).unwrap();
    std::os::unix::fs::symlink(
        fs::canonicalize(lib).unwrap(),
        shim.join("lib/charliecloud"),
    )
    .unwrap();
    let tmp = ch.env.tmp.path().join("wrapper-tmp");
    fs::create_dir(&tmp).unwrap();
    let shimmed = |mut c: Command| {
        let path = std::env::var("PATH").unwrap_or_default();
        let bin_dir = Path::new(bin()).parent().unwrap();
        c.env(
            "PATH",
            format!(
                "{}:{}:/usr/bin:{path}",
                shim.join("bin").display(),
                bin_dir.display()
            ),
        )
        .env("TMPDIR", &tmp);
        c
    };

    let mut c = ch.command(CH_DELETE);
    c.arg("ci_*");
    let delete = Bg::from_command(shimmed(c));
    wait_until("ch-delete has checked its set under the locks", || {
        fs::read_dir(&tmp)
            .unwrap()
            .flatten()
            .any(|w| w.path().join("started").exists())
    });
    ch.dockerfile("Dockerfile", &gated("base"));
    let build = Bg::from_command(shimmed(ch.ch_build([
        "-t",
        "ci_new",
        "--build-arg",
        "ID=n",
    ])));
    ch.wait_started("ci_new", "n");
    fs::write(&go, "").unwrap();
    let out = delete.finish();
    assert_ok_ref(&out);
    assert!(
        ch.img("ci_new/started-n").exists(),
        "ch-delete deleted ci_new, which a build held exclusively: {}",
        show(&out)
    );
    assert!(!stderr(&out).contains("ci_new"), "{}", show(&out));
    ch.go("ci_new", "n");
    assert_ok(build.finish());
    assert!(!ch.img("ci_old").exists());
    assert_eq!(ch.file("ci_new", "id"), "n");
    assert_eq!(ch.env.state("ci_new").as_deref(), Some("ready"));
    assert_eq!(ch.stowage_list(), ["base", "ci_new"]);
    assert_eq!(ch.ch_list(), ["base", "ci_new"]);
}

/// `ch-delete 'x*'` started while a reader holds `x1`, and `x2` built while
/// it waits: the set it planned changes under it. (The reader, the delete.)
fn delete_as_x2_appears(ch: &Ch) -> (Bg, Bg) {
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN true\n");
    assert_ok(output(ch.ch_build(["-t", "x1"])));
    let reader = ch.env.hold_until(&["--read", "x1"], "held", "release");
    let mut c = ch.command(CH_DELETE);
    c.arg("x*");
    let delete = Bg::from_command(c);
    ch.env.wait_for_waiter("x1");
    assert_ok(output(ch.ch_build(["-t", "x2"])));
    (reader, delete)
}

/// An image that begins to match while ch-delete waits for its locks is
/// found under them: ch-delete plans again, locks it too, and deletes
/// both.
#[test]
fn ch_delete_plans_again_for_an_image_that_matches_while_it_waits() {
    let Some(ch) = Ch::new() else { return };
    let (reader, delete) = delete_as_x2_appears(&ch);
    ch.env.release("release");
    assert_ok(reader.finish());
    let out = delete.finish();
    assert_ok_ref(&out);
    assert!(stderr(&out).contains("planning again"), "{}", show(&out));
    assert_eq!(ch.stowage_list(), ["base"]);
    assert_eq!(ch.ch_list(), ["base"]);
}
/// A signal the caller of ch-build ignored stays ignored for stowage and
/// the build: SIGHUP under nohup, SIGINT for a script's `ch-build … &`. The
/// signal reaching every process of the build then stops nothing. Before,
/// the wrapper reset them to their default for stowage, and a hang-up
/// ended the build (exit 129).
#[test]
fn a_signal_the_caller_of_ch_build_ignored_stays_ignored() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    for (i, sig) in [libc::SIGHUP, libc::SIGINT].into_iter().enumerate() {
        let tag = format!("app{i}");
        let id = format!("ign{i}-8812");
        let args = ["-t", &tag, "--build-arg", &format!("ID={id}")];
        let mut c = if sig == libc::SIGHUP {
            ch.command("nohup")
        } else {
            // A non-interactive shell's background job ignores SIGINT.
            let mut c = ch.command("bash");
            c.args(["-c", "\"$@\" & wait $!", "bash"]);
            c
        };
        c.arg(CH_BUILD).args(args).arg(&ch.ctx);
        let b = Bg::from_command(c);
        ch.wait_started(&tag, &id);
        let build: Vec<u32> = processes_with(&[&format!("ID={id}")])
            .into_iter()
            .map(|(p, _)| p)
            .filter(|&p| p != b.pid() || sig == libc::SIGHUP)
            .collect();
        // The wrapper, stowage, `ch-build --locked` and ch-image.
        assert!(build.len() >= 4, "{build:?}");
        for &p in &build {
            assert!(ignores(p, sig), "process {p} does not ignore signal {sig}");
        }
        for &p in &build {
            unsafe { libc::kill(p as i32, sig) };
        }
        ch.go(&tag, &id);
        let out = b.finish();
        assert_ok_ref(&out);
        assert_eq!(ch.env.state(&tag).as_deref(), Some("ready"));
        assert_eq!(ch.file(&tag, "id"), id);
    }
}
/// SIGKILL of the stowage a ch-build runs leaves the build going on under
/// the locks it inherited: ch-build says so, and how to see it, without
/// bash's job report in the log. Before, it said at once that the image
/// was left incomplete and to build it again, while it was still building.
#[test]
fn a_build_whose_stowage_is_killed_is_said_to_go_on_under_its_locks() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    let id = "ks-3390";
    // Its log in a file: the build, going on, keeps a pipe open.
    let log = ch.env.tmp.path().join("ks.log");
    let mut c = ch.ch_build(["-t", "app", "--build-arg", &format!("ID={id}")]);
    c.stderr(fs::File::create(&log).unwrap());
    let b = Bg::from_command_keep_stderr(c);
    ch.wait_started("app", id);
    let arg = format!("ID={id}");
    let stowage = processes_with(&[&arg, "exec"])
        .into_iter()
        .find(|(_, args)| args[0].ends_with("stowage"))
        .map(|(p, _)| p)
        .expect("the wrapper's stowage");
    unsafe { libc::kill(stowage as i32, libc::SIGKILL) };
    let out = b.finish();
    let err = fs::read_to_string(&log).unwrap();
    assert_eq!(out.status.code(), Some(137), "{err}");
    assert!(err.contains("may still be running"), "{err}");
    assert!(err.contains("lock-status app"), "{err}");
    assert!(!err.contains("build it again, or delete it"), "{err}");
    assert!(!err.contains("Killed"), "{err}");
    assert!(
        !flock_free(&ch.env.lock_file("app")),
        "the build holds its locks"
    );
    ch.go("app", id);
    wait_until("the build has ended", || {
        processes_mentioning(&arg).is_empty()
    });
    assert!(flock_free(&ch.env.lock_file("app")));
    assert_eq!(ch.env.state("app").as_deref(), Some("incomplete"));
}
/// ch-image run directly under `stowage exec --no-inherit`, as
/// docs/charliecloud.md gives its pulls, imports and store-wide commands:
/// killed alone, its RUN step (started without the lock descriptors) goes
/// on, and stowage holds the locks until that has ended too.
#[test]
fn ch_image_run_directly_with_no_inherit_holds_its_locks_until_its_tree_ends() {
    let Some(ch) = Ch::new() else { return };
    ch.dockerfile("Dockerfile", &gated("base"));
    let storage = ch.storage.display().to_string();
    let id = "direct-6120";
    let arg = format!("ID={id}");
    let mut c = ch.stowage(["exec", "--no-inherit", "--write", "app", "--", "ch-image"]);
    c.args([
        "-s",
        &storage,
        "--no-lock",
        "--no-cache",
        "build",
        "-t",
        "app",
    ])
    .args(["--build-arg", &arg])
    .arg(&ch.ctx);
    // Its log in a file: the RUN step keeps a pipe open.
    let log = ch.env.tmp.path().join("direct.log");
    c.stderr(fs::File::create(&log).unwrap());
    let mut exec = Bg::from_command_keep_stderr(c);
    ch.wait_started("app", id);
    let pid = ch_image_of(id);
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    wait_until("ch-image is reaped", || proc_state(pid).is_none());
    assert!(exec.is_running(), "stowage ended with the RUN step running");
    assert!(!flock_free(&ch.env.lock_file("app")));
    assert!(ch.img("app").join(format!("started-{id}")).exists());
    ch.go("app", id);
    let out = exec.finish();
    let err = fs::read_to_string(&log).unwrap();
    assert_eq!(out.status.code(), Some(137), "{err}");
    assert!(flock_free(&ch.env.lock_file("app")));
    assert!(!ch.img("app").join(format!("started-{id}")).exists());
    assert_eq!(ch.env.state("app").as_deref(), Some("incomplete"));
}
/// A Dockerfile FROM `base` whose RUN step (its arguments name `run-ID`)
/// makes /started, then runs on for about 5 s and succeeds.
fn running_on(id: &str) -> String {
    format!(
        "FROM base\nRUN : run-{id}; touch /started; i=0; \
         while [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done\n"
    )
}
/// Ctrl-C (SIGINT) stops a build whose caller ignores SIGTERM (a job
/// script's `trap '' TERM`): the build ends at once with 130, and its image
/// is left incomplete. Before, SIGINT went on to ch-image's group as a
/// SIGTERM that ch-image, inheriting the ignore, ignored: the build ran on
/// to its end.
#[test]
fn sigint_stops_a_build_whose_caller_ignores_sigterm() {
    let Some(ch) = Ch::new() else { return };
    let id = "ignterm-5127";
    ch.dockerfile("Dockerfile", &running_on(id));
    let mut c = ch.command("bash");
    c.args([
        "-c",
        "trap '' TERM; exec \"$@\"",
        "bash",
        CH_BUILD,
        "-t",
        "app",
    ])
    .arg(&ch.ctx);
    let b = Bg::from_command(c);
    wait_for_file(&ch.img("app").join("started"));
    assert!(ignores(b.pid(), libc::SIGTERM));
    b.signal(libc::SIGINT);
    let out = b.finish();
    assert_eq!(out.status.code(), Some(130), "{}", show(&out));
    assert!(stderr(&out).contains("stopped by SIGINT"), "{}", show(&out));
    assert!(processes_mentioning(&format!("run-{id}")).is_empty());
    assert_eq!(ch.env.state("app").as_deref(), Some("incomplete"));
}
/// SIGQUIT (Ctrl-\) to ch-build stops the build, as SIGINT does, whether
/// or not its caller ignores SIGINT; a caller's ignore of SIGQUIT itself is
/// kept, and the build goes on. bash ignores SIGQUIT itself, always: read
/// from the kernel's mask, every SIGQUIT was taken for an ignored one (the
/// build ran on, exit 0, `ready`), and read from SIGINT's, a caller's lone
/// ignore of either was misread.
#[test]
fn sigquit_stops_a_build_unless_its_caller_ignores_sigquit() {
    let Some(ch) = Ch::new() else { return };
    for (i, ignored) in ["", "INT", "QUIT"].into_iter().enumerate() {
        let (tag, id) = (format!("app{i}"), format!("quit{i}-5128"));
        ch.dockerfile("Dockerfile", &running_on(&id));
        let mut c = ch.command("bash");
        let trap = if ignored.is_empty() {
            String::new()
        } else {
            format!("trap '' {ignored}; ")
        };
        c.args([
            "-c",
            &format!("{trap}exec \"$@\""),
            "bash",
            CH_BUILD,
            "-t",
            &tag,
        ])
        .arg(&ch.ctx);
        let b = Bg::from_command(c);
        wait_for_file(&ch.img(&tag).join("started"));
        b.signal(libc::SIGQUIT);
        let out = b.finish();
        if ignored == "QUIT" {
            assert_ok_ref(&out);
            assert_eq!(ch.env.state(&tag).as_deref(), Some("ready"));
            continue;
        }
        assert_eq!(out.status.code(), Some(131), "{ignored}: {}", show(&out));
        assert!(processes_mentioning(&format!("run-{id}")).is_empty());
        assert_eq!(ch.env.state(&tag).as_deref(), Some("incomplete"));
    }
}
/// A build that fails, or is stopped by SIGTERM, while another build of
/// its tag waits for the lock, says it left the image incomplete. Before,
/// the waiting build's hold of the lock made it say that its stowage had
/// ended but the build might still be running.
#[test]
fn a_build_that_fails_with_another_queued_says_it_left_its_image_incomplete() {
    let Some(ch) = Ch::new() else { return };
    for (i, sig) in [None, Some(libc::SIGTERM)].into_iter().enumerate() {
        let tag = format!("app{i}");
        let id = format!("q{i}-3318");
        ch.dockerfile("Dockerfile", &gated("base"));
        let first = ch.build(&tag, &id);
        ch.wait_started(&tag, &id);
        let second = ch.build(&tag, &format!("{id}-2"));
        ch.env.wait_for_waiter(&tag);
        match sig {
            Some(s) => first.signal(s),
            // The RUN step fails: its sentinel is taken away.
            None => fs::remove_file(ch.img(&tag).join(format!("started-{id}"))).unwrap(),
        }
        if sig.is_none() {
            ch.go(&tag, &id);
        }
        let out = first.finish();
        let err = stderr(&out);
        assert!(!err.contains("may still be running"), "{}", show(&out));
        assert!(err.contains("left incomplete"), "{}", show(&out));
        ch.wait_started(&tag, &format!("{id}-2"));
        ch.go(&tag, &format!("{id}-2"));
        assert_ok(second.finish());
    }
}
/// SIGUSR1 to ch-build goes on through stowage and `ch-build --locked` to
/// the build (here ch-image, which it ends), and no wrapper dies of it: the
/// wrapper says what the build left, and nothing of the build outlives it.
/// Before, ch-build died of SIGUSR1 at once, saying nothing, while the
/// build went on.
#[test]
fn sigusr1_to_ch_build_goes_on_to_the_build() {
    let Some(ch) = Ch::new() else { return };
    let id = "usr1-7730";
    ch.dockerfile("Dockerfile", &running_on(id));
    let b = Bg::from_command(ch.ch_build(["-t", "app"]));
    wait_for_file(&ch.img("app").join("started"));
    b.signal(libc::SIGUSR1);
    let out = b.finish();
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGUSR1),
        "{}",
        show(&out)
    );
    assert!(
        stderr(&out).contains("stopped by SIGUSR1"),
        "{}",
        show(&out)
    );
    assert!(processes_mentioning(&format!("run-{id}")).is_empty());
    assert_eq!(ch.env.state("app").as_deref(), Some("incomplete"));
}
/// `ch-build --locked` passes SIGUSR1, SIGUSR2, SIGALRM and a real-time
/// signal on to its command as themselves, and lives on: a command that
/// handles them succeeds. Before, it died of the first.
#[test]
fn ch_build_locked_passes_user_signals_on_and_lives() {
    let env = Env::new();
    let got = env.sentinel("got");
    let started = env.sentinel("started");
    let script = format!(
        "for s in USR1 USR2 ALRM RTMIN+2; do trap \"echo $s >> {g}\" $s; done; \
         touch {st}; i=0; while [ \"$(wc -l < {g} 2>/dev/null)\" != 4 ] && [ $i -lt 1200 ]; do \
         sleep 0.05; i=$((i+1)); done; [ $i -lt 1200 ]",
        g = got.display(),
        st = started.display()
    );
    let mut c = Command::new(CH_BUILD);
    c.args(["--locked", "-t", "usr", "--", "bash", "-c", &script])
        .env("CH_BUILD_STARTED", env.sentinel("build-started"));
    let b = Bg::from_command(c);
    wait_for_file(&started);
    for sig in [
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGALRM,
        libc::SIGRTMIN() + 2,
    ] {
        let before = fs::read_to_string(&got).unwrap_or_default().lines().count();
        b.signal(sig);
        // One at a time: signals of one kind pending at once merge.
        wait_until("the command has it, or the wrapper died", || {
            fs::read_to_string(&got).unwrap_or_default().lines().count() > before
                || matches!(proc_state(b.pid()), None | Some('Z'))
        });
    }
    let out = b.finish();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert_eq!(
        fs::read_to_string(&got).unwrap(),
        "USR1\nUSR2\nALRM\nRTMIN+2\n"
    );
}
/// `ch-build --locked` waits out the grace of a build group it ends without
/// forking (a pids limit the build has exhausted refuses every fork): here
/// no `sleep` of PATH's is ever run. Before, each pause ran sleep(1), which
/// at the limit failed, and bash gave up while the group still wrote.
#[test]
fn ch_build_locked_ends_a_build_group_without_forking() {
    let env = Env::new();
    let shim = env.tmp.path().join("shim");
    fs::create_dir(&shim).unwrap();
    let forked = env.sentinel("forked");
    fs::write(
        shim.join("sleep"),
        format!(
            "#!/bin/sh\ntouch {}\nexec /bin/sleep \"$@\"\n",
            forked.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(shim.join("sleep"), fs::Permissions::from_mode(0o755)).unwrap();
    // The leader exits at once; what it left ignores SIGTERM, as a RUN
    // step that must not be cut short may, until SIGKILL.
    let script = "(trap '' TERM; : nofork-2291; while :; do /bin/sleep 0.05; done) & exit 3";
    let mut c = Command::new(CH_BUILD);
    let path = std::env::var("PATH").unwrap_or_default();
    c.args(["--locked", "-t", "nofork", "--", "sh", "-c", script])
        .env("PATH", format!("{}:/usr/bin:{path}", shim.display()))
        .env("CH_BUILD_STARTED", env.sentinel("build-started"));
    let out = output(c);
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    assert!(processes_mentioning("nofork-2291").is_empty());
    assert!(!forked.exists(), "end_group ran sleep(1)");
}
/// ch-delete that has to plan again leaves the images it found under the
/// locks, and did not delete, as they were: `ready`. Before, its step
/// under the locks exited 99, which stowage recorded as a failed write, and
/// an intact image was left `incomplete` (and for good, had it given up or
/// been stopped next).
#[test]
fn ch_delete_planning_again_leaves_the_images_ready() {
    let Some(ch) = Ch::new() else { return };
    let (reader, delete) = delete_as_x2_appears(&ch);
    // The second attempt waits for x2: the first has ended by then.
    let reader2 = ch.env.hold_until(&["--read", "x2"], "held2", "release2");
    ch.env.release("release");
    assert_ok(reader.finish());
    ch.env.wait_for_waiter("x2");
    assert_eq!(ch.env.state("x1").as_deref(), Some("ready"));
    ch.env.release("release2");
    assert_ok(reader2.finish());
    let out = delete.finish();
    assert_ok_ref(&out);
    assert!(stderr(&out).contains("planning again"), "{}", show(&out));
    assert_eq!(ch.stowage_list(), ["base"]);
}
/// ch-delete planning again leaves an image that was `incomplete` (a failed
/// build) incomplete: its step under the locks exits 0 only when every
/// image it locked was ready, since stowage records a write that exits 0
/// `ready`.
#[test]
fn ch_delete_planning_again_leaves_an_incomplete_image_incomplete() {
    let Some(ch) = Ch::new() else { return };
    ch.env.ok(["slots", "set", "ch-cache", "1"]);
    ch.dockerfile("Dockerfile", "FROM base\nRUN false\n");
    let failed = output(ch.ch_build(["-t", "x1"]));
    assert_ne!(failed.status.code(), Some(0), "{}", show(&failed));
    assert_eq!(ch.env.state("x1").as_deref(), Some("incomplete"));
    assert!(ch.img("x1").exists());
    // An incomplete image cannot be read: its lock file is held directly.
    let release = ch.env.sentinel("release");
    let holder = flock_holder(
        &ch.env.lock_file("x1"),
        &ch.env.sentinel("held"),
        &format!(
            "i=0; while [ ! -e '{}' ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done",
            release.display()
        ),
    );
    let mut c = ch.command(CH_DELETE);
    c.arg("x*");
    let delete = Bg::from_command(c);
    ch.env.wait_for_waiter("x1");
    ch.dockerfile("Dockerfile", "FROM base\nRUN true\n");
    assert_ok(output(ch.ch_build(["-t", "x2"])));
    let reader2 = ch.env.hold_until(&["--read", "x2"], "held2", "release2");
    fs::write(&release, "").unwrap();
    assert_ok(holder.finish());
    ch.env.wait_for_waiter("x2");
    assert_eq!(ch.env.state("x1").as_deref(), Some("incomplete"));
    assert_eq!(ch.env.state("x2").as_deref(), Some("ready"));
    ch.env.release("release2");
    assert_ok(reader2.finish());
    let out = delete.finish();
    assert_ok_ref(&out);
    assert_eq!(ch.stowage_list(), ["base"]);
}

/// A SIGUSR1 in a wrapper's first moments, before it passes signals on
/// (here sent by every `readlink` a wrapper shell runs at its start, so at
/// that moment always), is dropped: neither ch-build nor its `--locked`
/// shell under the locks dies of it, and the build succeeds.
#[test]
fn a_user_signal_at_a_wrappers_start_is_dropped() {
    let Some(ch) = Ch::new() else { return };
    let fake = ch.env.scratch.join("fake-bin");
    fs::create_dir_all(&fake).unwrap();
    let readlink = fake.join("readlink");
    fs::write(
        &readlink,
        "#!/bin/sh\np=$PPID\nwhile [ \"$p\" -gt 1 ]; do\n\
         tr '\\0' ' ' </proc/$p/cmdline | grep -q '^bash [^ ]*/ch-build ' && kill -USR1 $p\n\
         p=$(cut -d' ' -f4 /proc/$p/stat)\ndone\nexec /usr/bin/readlink \"$@\"\n",
    )
    .unwrap();
    let exe = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    fs::set_permissions(&readlink, exe).unwrap();
    ch.dockerfile("Dockerfile", "FROM base\nRUN true\n");
    let mut c = ch.ch_build(["-t", "app"]);
    let path = c
        .get_envs()
        .find(|(k, _)| *k == "PATH")
        .and_then(|(_, v)| v.map(ToOwned::to_owned))
        .unwrap();
    c.env(
        "PATH",
        format!("{}:{}", fake.display(), path.to_string_lossy()),
    );
    let out = output(c);
    assert_eq!(code(&out), Some(0), "{}", show(&out));
    assert_eq!(ch.env.state("app").as_deref(), Some("ready"));
}

/// A member of a group store builds FROM an image another member built
/// (not linked to the build cache, so the build gets a private copy of its
/// ch/): the copy keeps no owners, as the build's user namespace maps no
/// group store's group. Before, `cp -a` failed to keep them, and every
/// such build exited 1: the seed's second layer, built by members, failed.
#[test]
fn a_group_stores_member_builds_from_an_image_another_member_built() {
    if !root_or_skip("acting as a group store's members") {
        return;
    }
    let Some(ch) = Ch::new() else { return };
    let w = ch.env.tmp.path().join("group");
    fs::create_dir(&w).unwrap();
    for d in [ch.env.tmp.path(), w.as_path()] {
        std::os::unix::fs::chown(d, None, Some(100)).unwrap();
        let mode = if d == w { 0o2775 } else { 0o755 };
        fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    }
    let tarball = ch.base_tarball();
    fs::set_permissions(
        &tarball,
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    for (dir, from) in [("c1", "base"), ("c2", "mid")] {
        fs::create_dir(w.join(dir)).unwrap();
        fs::write(
            w.join(dir).join("Dockerfile"),
            format!("FROM {from}\nRUN echo x > /{dir}\n"),
        )
        .unwrap();
    }
    let script =
        "umask 002; export HOME=$W CH_IMAGE_STORAGE=$W/st STOWAGE_ROOT=$W/st.stowage; cd $W
        if [ $1 = first ]; then
            ch-image import \"$TAR\" base && stowage init --group 100 --images-dir $W/st/img &&
            \"$CH_BUILD\" -t mid c1
        else \"$CH_BUILD\" -t app c2; fi";
    for (uid, step) in [(64001, "first"), (64002, "second")] {
        let mut c = ch.command("setpriv");
        c.args([
            &format!("--reuid={uid}"),
            "--regid=100",
            "--groups=100",
            "--",
            "bash",
            "-c",
            script,
            "bash",
            step,
        ])
        .env("W", &w)
        .env("TAR", &tarball)
        .env(
            "CH_BUILD",
            Path::new(env!("CARGO_MANIFEST_DIR")).join(CH_BUILD),
        )
        .env("USER", format!("member{uid}"));
        let out = output(c);
        assert_eq!(out.status.code(), Some(0), "{step}: {}", show(&out));
        // An ACL naming an id the second member's namespace does not map, which no copy keeps.
        let meta = w.join("st/img/mid/ch/metadata.json");
        if step == "first"
            && !Command::new("setfacl")
                .args(["-m", "u:64003:rw"])
                .arg(&meta)
                .status()
                .is_ok_and(|s| s.success())
        {
            eprintln!("no ACL on the base's metadata: setfacl failed or is missing");
        }
    }
}
