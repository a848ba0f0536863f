//! The password file (`~/.pgpass`, `PGPASSFILE`, `passfile=`), read as libpq reads it
//! (passwordFromFile in fe-connect.c):
//!
//! - one entry per line, `hostname:port:database:username:password`; a line starting with `#`
//!   is a comment; a trailing CR/LF is ignored;
//! - each of the first four fields is a literal or `*` (alone) matching anything; `\:` and `\\`
//!   stand for `:` and `\` (in any field, the password too); the first matching line wins;
//! - the host looked up is the `host` value, else `hostaddr`; `localhost` is looked up for an
//!   empty host and for the default Unix-socket directory; the port is the port in use
//!   (5432 by default); the database defaults to the user name;
//! - the file is ignored, with a warning, when it is not a plain file or when group or others
//!   have any access to it (it must be 0600 or less); a missing file is ignored silently.
//!
//! The password is only ever handed to tokio-postgres: never logged, never printed.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use tracing::warn;

/// What one connection looks up.
#[derive(Debug, Clone, Copy)]
pub struct Lookup<'a> {
    pub host: &'a str,
    pub port: u16,
    pub database: &'a str,
    pub user: &'a str,
}

/// The password for `lookup` from the file at `path`, or None (no file, an unsafe file,
/// no matching line). Warnings go to the log, as libpq prints them on stderr.
pub fn password_from_file(path: &Path, lookup: &Lookup<'_>) -> Option<String> {
    // One descriptor for the checks and the read; non-blocking, so that a FIFO in the file's
    // place fails the plain-file check instead of hanging the connect.
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if let Err(problem) = check_file(meta.is_file(), meta.mode()) {
        warn!(
            "password file \"{}\" {problem}; ignoring it",
            path.display()
        );
        return None;
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).ok()?;
    let text = String::from_utf8_lossy(&bytes);
    find_password(&text, lookup)
}

/// libpq's checks on the file itself: a plain file without group or other access.
pub fn check_file(is_file: bool, mode: u32) -> Result<(), String> {
    if !is_file {
        return Err("is not a plain file".to_string());
    }
    if mode & 0o077 != 0 {
        return Err(format!(
            "has group or world access (mode {:04o}); permissions should be u=rw (0600) or less",
            mode & 0o7777
        ));
    }
    Ok(())
}

/// The first matching line's password.
pub fn find_password(text: &str, lookup: &Lookup<'_>) -> Option<String> {
    if lookup.database.is_empty() || lookup.user.is_empty() {
        return None;
    }
    let port = lookup.port.to_string();
    for line in text.split('\n') {
        if line.starts_with('#') {
            continue;
        }
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            continue;
        }
        let rest = match_field(line, lookup.host)
            .and_then(|rest| match_field(rest, &port))
            .and_then(|rest| match_field(rest, lookup.database))
            .and_then(|rest| match_field(rest, lookup.user));
        if let Some(password) = rest {
            return Some(unescape_password(password));
        }
    }
    None
}

/// pwdfMatchesString: the rest of the line after this field when the field matches
/// `token` (a literal with `\` escapes, or `*` alone), else None.
fn match_field<'a>(field: &'a str, token: &str) -> Option<&'a str> {
    if let Some(rest) = field.strip_prefix("*:") {
        return Some(rest);
    }
    let bytes = field.as_bytes();
    let token = token.as_bytes();
    let (mut i, mut t) = (0, 0);
    while i < bytes.len() {
        let mut escaped = false;
        if bytes[i] == b'\\' {
            i += 1;
            escaped = true;
            if i == bytes.len() {
                return None;
            }
        }
        if bytes[i] == b':' && !escaped && t == token.len() {
            return Some(&field[i + 1..]);
        }
        if t == token.len() || bytes[i] != token[t] {
            return None;
        }
        i += 1;
        t += 1;
    }
    None
}

/// The password field: up to an unescaped `:` or the end, backslashes removed.
fn unescape_password(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut chars = field.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ':' => break,
            '\\' if chars.peek().is_some() => out.push(chars.next().expect("peeked")),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup<'a>(host: &'a str, port: u16, database: &'a str, user: &'a str) -> Lookup<'a> {
        Lookup {
            host,
            port,
            database,
            user,
        }
    }

    #[test]
    fn exact_and_wildcard_fields() {
        let text = "db1:5432:postgres:ccm:secret1\n*:*:*:ccm:fallback\n";
        assert_eq!(
            find_password(text, &lookup("db1", 5432, "postgres", "ccm")).as_deref(),
            Some("secret1")
        );
        assert_eq!(
            find_password(text, &lookup("db2", 6000, "app", "ccm")).as_deref(),
            Some("fallback")
        );
        assert_eq!(
            find_password(text, &lookup("db1", 5432, "postgres", "other")),
            None
        );
    }

    #[test]
    fn first_match_wins() {
        let text = "*:*:*:*:first\ndb1:5432:postgres:ccm:second\n";
        assert_eq!(
            find_password(text, &lookup("db1", 5432, "postgres", "ccm")).as_deref(),
            Some("first")
        );
    }

    #[test]
    fn escapes_and_partial_matches() {
        // `\:` and `\\` in fields and in the password.
        let text = "h\\:x:5432:d\\\\b:u:pa\\:ss\\\\word\n";
        assert_eq!(
            find_password(text, &lookup("h:x", 5432, "d\\b", "u")).as_deref(),
            Some("pa:ss\\word")
        );
        // A field is matched whole, not as a prefix, and `*` only alone.
        let text = "db:5432:postgres:ccm:x\ndb1*:5432:postgres:ccm:y\n";
        assert_eq!(
            find_password(text, &lookup("db1", 5432, "postgres", "ccm")),
            None
        );
        // An unescaped colon ends the password (libpq), so does the end of the line.
        let text = "db1:5432:postgres:ccm:pw:extra\r\n";
        assert_eq!(
            find_password(text, &lookup("db1", 5432, "postgres", "ccm")).as_deref(),
            Some("pw")
        );
    }

    #[test]
    fn comments_blank_and_short_lines() {
        let text = "# db1:5432:postgres:ccm:commented\n\ndb1:5432\ndb1:5432:postgres:ccm:real";
        assert_eq!(
            find_password(text, &lookup("db1", 5432, "postgres", "ccm")).as_deref(),
            Some("real")
        );
        // An empty password is a password.
        assert_eq!(
            find_password("*:*:*:*:\n", &lookup("h", 1, "d", "u")).as_deref(),
            Some("")
        );
        // No user or database: no lookup (libpq).
        assert_eq!(find_password("*:*:*:*:x", &lookup("h", 1, "", "u")), None);
    }

    #[test]
    fn port_is_compared_as_text() {
        let text = "db1:6000:*:*:six\ndb1:5432:*:*:default\n";
        assert_eq!(
            find_password(text, &lookup("db1", 5432, "d", "u")).as_deref(),
            Some("default")
        );
        assert_eq!(
            find_password(text, &lookup("db1", 6000, "d", "u")).as_deref(),
            Some("six")
        );
    }

    #[test]
    fn unsafe_files_are_refused() {
        assert!(check_file(true, 0o100600).is_ok());
        assert!(check_file(true, 0o100400).is_ok());
        assert!(check_file(true, 0o100640)
            .unwrap_err()
            .contains("group or world access"));
        assert!(check_file(true, 0o100604).is_err());
        assert!(check_file(false, 0o040700)
            .unwrap_err()
            .contains("not a plain file"));
    }

    #[test]
    fn reads_a_file_and_ignores_an_open_one() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("ccm-agent-pgpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pgpass");
        std::fs::write(&path, "localhost:5432:postgres:ccm:from-file\n").unwrap();
        let l = lookup("localhost", 5432, "postgres", "ccm");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(password_from_file(&path, &l).as_deref(), Some("from-file"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(password_from_file(&path, &l), None);
        assert_eq!(password_from_file(&dir.join("missing"), &l), None);
        assert_eq!(
            password_from_file(&dir, &l),
            None,
            "a directory is not a password file"
        );
        // A FIFO (no writer) is refused at once instead of blocking the open.
        let fifo = dir.join("fifo");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path only.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        assert_eq!(password_from_file(&fifo, &l), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
