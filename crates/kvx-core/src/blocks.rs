//! A request's blocks in the further KV cache groups of a hybrid model.

use crate::ids::BlockId;

/// The blocks of one further KV cache group of a request, beside the first group's (which
/// every request has, and which the APIs carry as `blocks`).
///
/// Hybrid models (vLLM's hybrid KV cache manager) keep several groups of layers, each with its
/// own blocks for the same tokens: full attention beside sliding window, where a group keeps
/// only the window's blocks. The engine shares each cache tensor among the groups, one layer of
/// each, so every layer of a [`LayoutSpec`](crate::LayoutSpec) holds every group: a group's
/// blocks move through every layer, at the same token positions as the first group's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GroupBlocks {
    /// The group keeps no KV for the tokens before this one (a sliding window's past): the
    /// entries of `blocks` for them are placeholders, never read or written. A group moves the
    /// tokens that both sides keep.
    pub first_token: u32,
    /// The group's blocks in token order, covering tokens from token 0.
    pub blocks: Vec<BlockId>,
}

/// Most groups one request may carry beside its first: more than any hybrid model has (a
/// Gemma-3-style model with five sliding layers to one full layer has six groups).
pub const MAX_GROUPS: usize = 64;

/// A request's blocks in every KV cache group: the first group's, and those of the further
/// groups of a hybrid model. A plain block list is a request of one group.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct RequestBlocks {
    /// The first group's blocks, in token order from token 0.
    pub blocks: Vec<BlockId>,
    /// The further groups' (none for a model of one group).
    pub groups: Vec<GroupBlocks>,
}

impl From<Vec<BlockId>> for RequestBlocks {
    fn from(blocks: Vec<BlockId>) -> Self {
        Self {
            blocks,
            groups: Vec::new(),
        }
    }
}
