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

const CH_BUILD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/ch-build");

/// A store whose images live in a Charliecloud storage directory.
struct Ch {
    env: Env,
    storage: PathBuf,
    ctx: PathBuf,
}

impl Ch {
    /// Storage with the base image `base` imported and adopted, or `None`
    /// (after saying why) where this machine cannot build with ch-image.
    fn new() -> Option<Ch> {
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
        Ch { env, storage, ctx }
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
        let tarball = self.env.tmp.path().join("base.tar");
        let mut tar = Command::new("tar");
        tar.arg("-C").arg(&rootfs).arg("-cf").arg(&tarball).arg(".");
        assert_ok(output(tar));

        let mut import = self.ch_image(["import"]);
        import.arg(&tarball).arg("base");
        assert_ok(output(import));
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
    fn command(&self, prog: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new(prog);
        let bin_dir = Path::new(bin()).parent().unwrap();
        let path = std::env::var("PATH").unwrap_or_default();
        c.env("PATH", format!("{}:/usr/bin:{path}", bin_dir.display()))
            .env("USER", user())
            .env("CH_IMAGE_STORAGE", &self.storage)
            .env("STOWAGE_ROOT", &self.env.root)
            .env_remove("CH_IMAGE_CACHE")
            .env_remove("STOWAGE_HOSTNAME")
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
    fn ch_build<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(&self, args: I) -> Command {
        let mut c = self.command(CH_BUILD);
        c.args(args).arg(&self.ctx);
        c
    }

    /// `scripts/ch-build -t TAG --build-arg ID=ID` in the background.
    fn build(&self, tag: &str, id: &str) -> Bg {
        Bg::from_command(self.ch_build(["-t", tag, "--build-arg", &format!("ID={id}")]))
    }

    fn dockerfile(&self, name: &str, text: &str) -> String {
        let p = self.ctx.join(name);
        fs::write(&p, text).unwrap();
        p.display().to_string()
    }

    /// An image's directory (names here need no encoding).
    fn img(&self, name: &str) -> PathBuf {
        self.storage.join("img").join(name)
    }

    fn wait_started(&self, tag: &str, id: &str) {
        wait_for_file(&self.img(tag).join(format!("started-{id}")));
    }

    fn go(&self, tag: &str, id: &str) {
        fs::write(self.img(tag).join(format!("go-{id}")), "").unwrap();
    }

    fn file(&self, tag: &str, path: &str) -> String {
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

fn assert_ok(out: std::process::Output) {
    assert_ok_ref(&out);
}

fn assert_ok_ref(out: &std::process::Output) {
    assert_eq!(out.status.code(), Some(0), "{}", show(out));
}

/// A Dockerfile FROM `base` whose RUN records its build argument ID, then
/// waits (bounded, 60 s) until the test writes `/go-ID` into the image.
fn gated(base: &str) -> String {
    format!(
        "FROM {base}\nARG ID\n\
         RUN echo \"$ID\" > /id && touch \"/started-$ID\" && i=0 && \
         while [ ! -e \"/go-$ID\" ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done && \
         rm \"/go-$ID\" \"/started-$ID\"\n"
    )
}

#[test]
fn parallel_builds_from_one_base_share_it() {
    let Some(ch) = Ch::new() else { return };
    const N: usize = 6;
    ch.dockerfile("Dockerfile", &gated("base"));
    let builds: Vec<Bg> = (0..N)
        .map(|i| ch.build(&format!("app{i}"), &i.to_string()))
        .collect();
    for i in 0..N {
        ch.wait_started(&format!("app{i}"), &i.to_string());
    }
    // All of them are inside their RUN step at once, each reading the base.
    let base = ch.env.lock_entry("base").unwrap();
    assert_eq!(base["state"], "shared", "{base}");
    assert_eq!(base["holders"].as_array().unwrap().len(), N, "{base}");

    for i in 0..N {
        ch.go(&format!("app{i}"), &i.to_string());
    }
    for b in builds {
        assert_ok(b.finish());
    }
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
    wait_until("the second build waits for 'app'", || {
        !ch.waiters("app").is_empty()
    });
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
    wait_until("the delete waits for 'base'", || {
        !ch.waiters("base").is_empty()
    });
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

#[test]
fn a_base_without_a_cache_link_is_locked_exclusively_and_stays_ready() {
    let Some(ch) = Ch::new() else { return };
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
    let two = ch.build("two", "two");
    let lock = ch.env.lock_file("app");
    wait_until("the second build waits for 'app'", || {
        someone_waits_for(&lock)
    });
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
        stderr(&out).contains("waiting for exclusive lock on base 'app'"),
        "{}",
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
        stderr(&out).contains("base image not ready: bad (incomplete)"),
        "{}",
        show(&out)
    );
    assert!(!ch.img("worse").exists());
}

/// Is a process blocked in flock(2) on this file? /proc/locks lists each
/// waiter as a "->" line naming the file's device (hex major:minor) and inode.
fn someone_waits_for(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = fs::metadata(path) else {
        return false;
    };
    let id = format!(
        "{:02x}:{:02x}:{}",
        libc::major(md.dev()),
        libc::minor(md.dev()),
        md.ino()
    );
    fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .any(|l| l.contains("->") && l.split_whitespace().any(|f| f == id))
}

#[test]
fn a_base_that_loses_its_cache_link_while_awaited_is_locked_anew() {
    let Some(ch) = Ch::new() else { return };
    let mut hold = ch.stowage(["exec", "--write", "base", "--"]);
    hold.args(ch.env.hold_cmd("held", "release"));
    let holder = Bg::from_command(hold);
    wait_for_file(&ch.env.sentinel("held"));

    ch.dockerfile("Dockerfile", "FROM base\nRUN echo x > /x\n");
    let build = Bg::from_command(ch.ch_build(["-t", "app"]));
    wait_until("the build waits for 'base'", || {
        ch.waiters("base").iter().any(|w| w["mode"] == "shared")
    });
    // What a --no-cache rebuild of base would do while the build waits.
    fs::remove_file(ch.img("base/.git")).unwrap();
    ch.env.release("release");
    assert_ok(holder.finish());

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

/// --dry-run needs no ch-image: the locks follow from the FROM lines and
/// from which bases are linked to the build cache.
#[test]
fn ch_build_derives_locks_from_from_lines() {
    let ch = Ch::empty();
    for d in ["team%base+1.0/.git", "tools+2", "scratch"] {
        fs::create_dir_all(ch.storage.join("img").join(d)).unwrap();
    }
    ch.dockerfile(
        "Dockerfile",
        "# syntax comment\n\
         ARG BASE=team/base:1.0\n\
         ARG TOOLS\n\
         from --platform=linux/amd64 ${BASE} AS build\n\
         RUN make \\\n  FROM not/a/base\n\
         FROM $TOOLS as tools\n\
         FROM team/base:1.0\n\
         FROM scratch\n\
         COPY --from=build /x /x\n",
    );
    let out = output(ch.ch_build(["--dry-run", "-t", "app", "--build-arg", "TOOLS=tools:2"]));
    assert_ok_ref(&out);
    let storage = ch.storage.display();
    let ctx = ch.ctx.display();
    let locks = ch.env.root.join("locks/images");
    let locks = locks.display();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!(
            "flock -x {locks}/scratch.lock flock -x {locks}/tools+2.lock \
             stowage exec --read team/base:1.0 --write app --write app_stage0 \
             --write app_stage1 --write app_stage2 -- \
             ch-image -s {storage} --no-lock --no-cache build -t app \
             --build-arg TOOLS=tools:2 {ctx}"
        )
    );
    let err = stderr(&out);
    assert!(
        err.contains("locking base 'tools:2' exclusively")
            && err.contains("locking base 'scratch' exclusively"),
        "{err}"
    );
    assert!(!err.contains("'team/base:1.0' exclusively"), "{err}");

    // --root goes to stowage; bases linked to the cache need no flock.
    let df = ch.dockerfile("Dockerfile.one", "FROM team/base:1.0\n");
    let out = output(ch.ch_build([
        "--dry-run",
        "--root",
        "/r",
        "--wait",
        "5",
        "-t",
        "x",
        "-f",
        &df,
    ]));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!(
            "stowage --root /r exec --wait 5 --read team/base:1.0 --write x -- \
             ch-image -s {storage} --no-lock --no-cache build -t x -f {df} {ctx}"
        ),
        "{}",
        show(&out)
    );
}

#[test]
fn ch_build_refuses_what_it_cannot_lock_correctly() {
    let ch = Ch::empty();
    fs::create_dir_all(ch.storage.join("img/base/.git")).unwrap();
    let img = ch.storage.join("img").display().to_string();
    ch.env.ok(["init", "--images-dir", &img]);
    let refused = |text: &str, env: &[(&str, &str)], code: i32, says: &str| {
        let df = ch.dockerfile("Dockerfile.t", text);
        let mut c = ch.ch_build(["-t", "app", "-f", &df]);
        c.envs(env.iter().copied());
        let out = output(c);
        assert_eq!(out.status.code(), Some(code), "{text}: {}", show(&out));
        assert!(stderr(&out).contains(says), "{text}: {}", show(&out));
    };
    // ch-image 0.31 reads FROM STAGE as an image to pull, not the stage.
    refused(
        "FROM base AS build\nFROM build\n",
        &[],
        64,
        "names an earlier stage",
    );
    refused("FROM nowhere\n", &[], 66, "base image 'nowhere' is not in");
    refused("FROM $B\n", &[], 64, "$B, which has no value");
    refused("FROM app\n", &[], 64, "an image this build writes");
    refused("RUN true\n", &[], 64, "no FROM line");
    refused(
        "FROM base\n",
        &[("CH_IMAGE_STORAGE", "relative")],
        64,
        "must be absolute",
    );
    // Locks in a root whose images are elsewhere would protect nothing.
    let other = ch.env.tmp.path().join("other-root").display().to_string();
    refused(
        "FROM base\n",
        &[("STOWAGE_ROOT", other.as_str())],
        64,
        "stowage init --images-dir",
    );
    assert!(!ch.img("app").exists());
}
