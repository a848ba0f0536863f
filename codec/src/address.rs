//! Page addresses: the buffer tag fields both nodes of a physical replica agree on.

/// Highest fork number (INIT_FORKNUM).
pub const MAX_FORK: u8 = 3;
/// MaxBlockNumber; 0xFFFFFFFF is InvalidBlockNumber.
pub const MAX_BLOCK: u32 = 0xFFFF_FFFE;
/// Largest usage count a block list may carry: PostgreSQL's BM_MAX_USAGE_COUNT.
pub const MAX_USAGE: u8 = 5;

/// One relation fork: tablespace, database, relfilenode, fork.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RelFork {
    pub spc: u32,
    pub db: u32,
    pub rel: u32,
    pub fork: u8,
}

impl RelFork {
    pub fn block(self, block: u32) -> BlockAddress {
        BlockAddress { spc: self.spc, db: self.db, rel: self.rel, fork: self.fork, block }
    }
}

/// Address of one page (a PostgreSQL buffer tag). Ordered by (spc, db, rel, fork, block).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockAddress {
    pub spc: u32,
    pub db: u32,
    pub rel: u32,
    pub fork: u8,
    pub block: u32,
}

impl BlockAddress {
    pub fn rel_fork(&self) -> RelFork {
        RelFork { spc: self.spc, db: self.db, rel: self.rel, fork: self.fork }
    }

    /// The 17 bytes that are hashed: spc, db, rel (u32 LE), fork, block (u32 LE).
    pub(crate) fn key(&self) -> [u8; 17] {
        let mut key = [0u8; 17];
        key[0..4].copy_from_slice(&self.spc.to_le_bytes());
        key[4..8].copy_from_slice(&self.db.to_le_bytes());
        key[8..12].copy_from_slice(&self.rel.to_le_bytes());
        key[12] = self.fork;
        key[13..17].copy_from_slice(&self.block.to_le_bytes());
        key
    }
}

/// A block and how hot it is on the primary (its clock-sweep usage count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HotBlock {
    pub addr: BlockAddress,
    pub usage: u8,
}
