// Every BRAID_* knob of the core, with its default and the reason for it, in one place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace braid {

enum class Algo : uint32_t {
  kAuto = 0,
  kOneShot = 1,  // every rank publishes its input, every rank reduces all inputs
  kTwoShot = 2,  // pipelined reduce-scatter + all-gather through shared-memory slots
  kRing = 3,     // ring reduce-scatter + all-gather between neighbours (on one host through
                 // shared memory; across hosts the part between hosts, over TCP)
  // Across hosts (ranks on one host take the automatic choice for these):
  kHierarchical = 4,  // reduce-scatter on the host, slices across hosts, all-gather on the host
  kLeaders = 5,       // host sums through the host leaders, then a broadcast on each host
  kDoubling = 6,      // through the host leaders, recursive doubling between them (small messages)
  // Not a choice: what the flight recorder names a collective that read its peers' registered
  // buffers in place (algorithms/window_collectives.cc) instead of running the algorithm chosen.
  kWindow = 7,
};
constexpr int kNumAlgos = 7;  // the choices (BRAID_ALGO): kAuto .. kDoubling
const char* algo_name(Algo a);
Algo parse_algo(const std::string& s);  // throws std::invalid_argument

struct Tunables {
  // BRAID_ALGO: auto | oneshot | twoshot | ring | hierarchical | leaders (all_reduce only; the
  // others pick by size). On one host: the shared-memory algorithm. Across hosts: oneshot sends
  // every message in one round trip between the host leaders, hierarchical and leaders pick the
  // cross-host structure with direct transfers between hosts, ring runs the part between hosts
  // around a ring (see Communicator::all_reduce_algo), and twoshot the steps on each host.
  Algo algo = Algo::kAuto;
  // BRAID_ONESHOT_MAX_BYTES: largest message (bytes a rank publishes) sent one-shot. One-shot
  // makes every rank read n copies of the message, two-shot about two but with three
  // synchronizations per round. At 2 ranks one-shot wins up to 1 MiB and loses at 4 MiB; at 3
  // and 4 ranks it wins up to 32 KiB (measured: docs/results/2026-11-21-epyc-avx512-2vcpu.md,
  // "Algorithm crossovers"). Default (-1): 1 MiB for 2 ranks, 32 KiB otherwise.
  int64_t oneshot_max_bytes = -1;
  // BRAID_SLOT_BYTES: capacity of one pipeline slot. Small enough that the slots of all ranks
  // stay in the last-level cache while data flows through them, large enough to amortize the
  // synchronizations of a round (measured against 256 KiB and 1 MiB:
  // docs/results/2026-11-21-epyc-avx512-2vcpu.md, "Pipeline slot size").
  size_t slot_bytes = 512 * 1024;
  // BRAID_STREAM_MIN_BYTES: reduce_scatter, all_gather and broadcast outputs at least this large
  // (bytes per rank) are written with non-temporal stores: they would not stay in cache, and the
  // stores skip the read-for-ownership. What matters is whether the outputs of all local ranks
  // together fit the shared last-level cache, so the default (-1) is half the L3 divided by the
  // number of local ranks: 8 MiB for 2 ranks and 4 MiB for 4 on a 32 MiB L3 (measured at 2 ranks:
  // docs/results/2026-11-21-epyc-avx512-2vcpu.md, "Streaming stores at 2 ranks"; at 4 ranks:
  // docs/results/2026-11-23-epyc-avx2-2vcpu.md, "Streaming threshold at 4 ranks").
  int64_t stream_min_bytes = -1;
  // BRAID_NSLOTS: pipeline depth (slots in flight per rank). At least 2: the ring writes slot
  // p while its right neighbour still reads slot p - 1.
  int nslots = 4;
  // BRAID_P2P_WINDOW_MIN_BYTES: a send from a registered buffer of at least this many bytes that
  // waits for its receiver anyway (inside an all_to_all with split sizes, or past the mailbox's
  // eager 4 MiB) offers the receiver its data in place, one copy instead of two
  // (transport/shm/mailbox.cc). all_to_allv at 2 ranks: pieces of 16-32 KiB 1.2x faster in place,
  // 64 KiB and more 1.4-1.6x, below 16 KiB no difference beyond the noise (measured:
  // docs/design/one-host.md, "Point-to-point from registered buffers").
  size_t p2p_window_min_bytes = 16 * 1024;
  // BRAID_SPIN_US / BRAID_YIELD_US: busy-poll, then sched_yield, before a futex sleep. When a
  // host runs more ranks than it has cores, the spin defaults to 0 so waiting ranks give their
  // core to the ranks that compute.
  double spin_us = -1.0;  // -1: decided from the number of ranks and cores
  // BRAID_SKEW_ROUNDS: 1 runs the two-shot all-reduce's phases skewed across rounds (each rank
  // reduces round i while publishing round i + 1), 0 in lockstep. Skewed is faster at 2 ranks,
  // lockstep with more ranks than cores (measured: docs/results/2026-11-21-epyc-avx512-2vcpu.md,
  // "Skewed pipelines"). Default (-1): skewed when every local rank has a core of its own.
  int skew_rounds = -1;
  double yield_us = 50.0;

  // Device tensors between the ranks of one host (CUDA IPC, ipc/ipc_collectives.h).
  // BRAID_IPC_ONE_SHOT_MAX_BYTES: all_reduce messages up to this many bytes per rank go in one
  // shot (every rank reads all N inputs and reduces them: one host step per piece, N reads of the
  // message), larger ones in two (a reduce-scatter of chunks, then an all-gather: two host steps
  // per piece, about two reads). The synchronizations bound small messages, the reads large ones.
  // 256 KiB per rank, to be measured on a GPU. Every value is valid: 0 sends every message in two
  // shots. Read once per process (ipc_one_shot_max_bytes()): the schedules take no Tunables.
  size_t ipc_one_shot_max_bytes = 256 * 1024;

  // Across hosts (TCP).
  // BRAID_NSOCKS: sockets per peer pair (and channel) that a message is striped across. More help
  // where one TCP flow cannot fill the link (long fat links, NICs that spread flows over queues).
  // Between two simulated hosts one socket was as fast as 2 or 4 on every link, within the noise
  // (measured: docs/results/2026-11-25-epyc-2vcpu.md, "Sockets per peer"), as in NCCL's default
  // for plain NICs.
  int nsocks = 1;
  static constexpr int kMaxSockets = 64;  // nsocks in [1, kMaxSockets] (here and in TcpTransport)
  // BRAID_SOCKET_CHUNK_BYTES: the striping unit; each chunk carries a 72-byte header. This and
  // BRAID_CROSS_PIECE_BYTES were the best pair tried (measured: docs/results/2026-11-25-epyc-2vcpu.md,
  // "Piece and chunk sizes").
  size_t socket_chunk_bytes = 512 * 1024;
  static constexpr size_t kMinSocketChunkBytes = 4096, kMaxSocketChunkBytes = size_t(1) << 30;
  // BRAID_CROSS_ONESHOT_MAX_BYTES: all_reduce messages up to this size cross hosts in one round
  // trip (every host leader sends its host's sum to every other) instead of a reduce-scatter to
  // owners and their results back (two message latencies, but each link carries 2/n of it).
  size_t cross_oneshot_max_bytes = 64 * 1024;
  // BRAID_CROSS_DOUBLING_MIN_HOSTS: from this many hosts up, those small all_reduce messages go
  // by recursive doubling between the host leaders (ceil(log2 H) rounds, a pair of ranks per
  // round) instead of the one round trip in which every leader sends to every other: fewer
  // messages per leader and log2 H connections instead of H - 1. Measured with 4 KiB on 100 Mbit
  // links: 0.65 against 0.99 ms at 4 hosts, 1.03 against 2.44 at 8, 1.5 against 5.4 at 16; equal
  // at 3 (docs/results/2026-11-26-xeon-2vcpu.md, "Many hosts"). At 2 hosts both are one exchange.
  int cross_doubling_min_hosts = 4;
  // reduce_scatter and all_gather between hosts have no knob: directly at two hosts (one step
  // either way), around the ring from three (one flow through each uplink instead of H - 1 at
  // once, the same bytes). Measured: an 8 MiB reduce_scatter at 8 x 1 hosts on 100 Mbit took
  // 670 ms around the ring against 864 ms direct (ring optimum 587 ms; same file, "Many hosts").
  // BRAID_CROSS_PIECE_BYTES: an owner reduces its part in pieces of this size as they arrive,
  // and sends each reduced piece on while the next ones travel.
  size_t cross_piece_bytes = 1024 * 1024;
  // BRAID_TCP_CONNECT: "lazy" opens the connections to a rank on another host when an algorithm
  // first uses that pair (descriptors and setup grow with the peers used, not with the number
  // of ranks: a ring holds 2 neighbours where a full mesh at 1,000 ranks would hold 2,000
  // sockets); "eager" opens every pair's while the communicator is built (errors such as an
  // unreachable host then surface there, and the first collective pays no setup).
  bool tcp_lazy = true;

  // The flight recorder (trace.h). BRAID_TRACE_BUFFER: calls each communicator remembers, 0 for
  // none. A call costs an atomic increment, two tick reads and a few stores, no lock (measured:
  // `python -m braid.bench recorder`; docs/results, "Flight recorder's cost").
  size_t trace_buffer = 2000;
  static constexpr size_t kMaxTraceBuffer = size_t(1) << 24;  // validate()'s bound

  static Tunables from_env();
  // Fills in what depends on the world size and the host: one-shot limit, streaming threshold,
  // spin budget, skew. `host_cores`: the CPUs the host's ranks may run on together (the union of
  // their affinity masks); 0 takes this process's own count, the first guess before the host's
  // ranks have met (Communicator::attach resolves again with the union).
  void resolve(int local_world_size, int host_cores = 0);
  void validate() const;  // throws std::invalid_argument naming the knob
};

// The byte count in environment variable `name` (digits, optional K/M/G suffix), `dflt` when it is
// unset; throws std::invalid_argument naming it when malformed. For knobs declared elsewhere
// (StagingOptions in staging.h).
size_t env_bytes(const char* name, size_t dflt);

}  // namespace braid
