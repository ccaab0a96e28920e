//! Where snapshot blobs live: a small key → bytes trait, and a local directory behind it.
//!
//! The trait is what an object store shared by several replicas would implement later; the
//! directory store writes atomically (temporary file, fsync, rename), bounds its size by
//! evicting the least recently used files, and indexes what is there when it opens.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A store of named blobs (keys are short lower-case hex strings).
pub trait SnapshotStore: Send {
    /// Whether `key` is stored.
    fn contains(&self, key: &str) -> bool;
    /// The blob of `key`, `None` when absent.
    fn get(&mut self, key: &str) -> io::Result<Option<Vec<u8>>>;
    /// Stores a blob (replacing one of the same key); may evict others to stay in bounds.
    fn put(&mut self, key: &str, bytes: &[u8]) -> io::Result<()>;
    /// Removes a blob (absent is fine).
    fn remove(&mut self, key: &str) -> io::Result<()>;
    /// Blobs stored.
    fn len(&self) -> usize;
    /// True when nothing is stored.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const EXT: &str = "tkvb";

/// Blobs as files `<key>.tkvb` in one directory, at most `max_bytes` in all.
#[derive(Debug)]
pub struct DirStore {
    dir: PathBuf,
    max_bytes: u64,
    /// key → (size, last use tick).
    index: HashMap<String, (u64, u64)>,
    total: u64,
    tick: u64,
}

fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.len() <= 128 && key.bytes().all(|b| b.is_ascii_hexdigit())
}

impl DirStore {
    /// Opens (creating) `dir` and indexes the blobs in it, oldest modification first;
    /// stale temporary files of an interrupted write are removed.
    pub fn open(dir: &Path, max_bytes: u64) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let mut found = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".tmp-") {
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(key) = name.strip_suffix(&format!(".{EXT}")) else {
                continue;
            };
            if !valid_key(key) {
                continue;
            }
            let meta = entry.metadata()?;
            if !meta.is_file() {
                continue;
            }
            let mtime = meta.modified().ok();
            found.push((mtime, key.to_string(), meta.len()));
        }
        found.sort();
        let mut store = Self {
            dir: dir.to_path_buf(),
            max_bytes,
            index: HashMap::new(),
            total: 0,
            tick: 0,
        };
        for (_, key, size) in found {
            store.tick += 1;
            store.total += size;
            store.index.insert(key, (size, store.tick));
        }
        store.evict_to(max_bytes)?;
        Ok(store)
    }

    /// Bytes stored.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.{EXT}"))
    }

    fn evict_to(&mut self, limit: u64) -> io::Result<()> {
        while self.total > limit {
            let Some(oldest) = self
                .index
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            tracing::debug!(key = %oldest, "snapshot store full: evicting the least recently used blob");
            self.remove(&oldest)?;
        }
        Ok(())
    }
}

impl SnapshotStore for DirStore {
    fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    fn get(&mut self, key: &str) -> io::Result<Option<Vec<u8>>> {
        if !self.index.contains_key(key) {
            return Ok(None);
        }
        match fs::read(self.path(key)) {
            Ok(bytes) => {
                self.tick += 1;
                if let Some(e) = self.index.get_mut(key) {
                    e.1 = self.tick;
                }
                Ok(Some(bytes))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if let Some((size, _)) = self.index.remove(key) {
                    self.total -= size;
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn put(&mut self, key: &str, bytes: &[u8]) -> io::Result<()> {
        if !valid_key(key) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "snapshot keys are hex",
            ));
        }
        let size = bytes.len() as u64;
        if size > self.max_bytes {
            return Ok(()); // never fits: not stored
        }
        self.remove(key)?;
        self.evict_to(self.max_bytes - size)?;
        let tmp = self.dir.join(format!(".tmp-{key}"));
        {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        fs::rename(&tmp, self.path(key))?;
        // The rename is durable once the directory is synced.
        if let Ok(d) = fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        self.tick += 1;
        self.total += size;
        self.index.insert(key.to_string(), (size, self.tick));
        Ok(())
    }

    fn remove(&mut self, key: &str) -> io::Result<()> {
        if let Some((size, _)) = self.index.remove(key) {
            self.total -= size;
            match fs::remove_file(self.path(key)) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    fn len(&self) -> usize {
        self.index.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puts_are_indexed_on_reopen_and_bounded_lru() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DirStore::open(dir.path(), 250).unwrap();
        s.put("aa", &[1; 100]).unwrap();
        s.put("bb", &[2; 100]).unwrap();
        assert_eq!(s.get("aa").unwrap().unwrap(), vec![1; 100]); // aa is now the newer
        s.put("cc", &[3; 100]).unwrap();
        assert!(s.contains("aa") && s.contains("cc") && !s.contains("bb"));
        assert_eq!(s.total_bytes(), 200);
        s.put("dd", &[0; 300]).unwrap(); // larger than the bound: not stored
        assert!(!s.contains("dd"));
        assert!(s.put("../x", &[0]).is_err());
        fs::write(dir.path().join(".tmp-ee"), b"partial").unwrap();
        fs::write(dir.path().join("notes.txt"), b"other").unwrap();
        drop(s);
        let mut s = DirStore::open(dir.path(), 250).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s.get("cc").unwrap().unwrap(), vec![3; 100]);
        assert!(
            !dir.path().join(".tmp-ee").exists(),
            "stale temp files are removed"
        );
        s.remove("cc").unwrap();
        assert!(s.get("cc").unwrap().is_none());
        let s = DirStore::open(dir.path(), 50).unwrap();
        assert_eq!(s.len(), 0, "a smaller bound evicts on open");
    }
}
