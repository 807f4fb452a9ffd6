// broadcast.hpp — trainer → inference weight broadcast, and its reference receiver.
//
// Owns: sending the current weights every broadcast.interval steps, either over
// the broadcast communicator (trainer rank 0 + the receivers of an MPMD launch;
// host MPI on the CPU backend, a device communicator on GPUs: NCCL, or MPI
// staged through host memory where two of its ranks share a GPU) or through the
// filesystem (<broadcast.dir>/step_<N>/model.safetensors + config.json +
// STABLE), and `shardlm receive`, which checks what arrives. On the filesystem
// path the receivers of the job acknowledge each step they finished reading
// (MPI, to trainer rank 0), and retention removes only directories every
// receiver has acknowledged: a slow receiver holds the trainers back once
// broadcast.keep directories wait for it, for at most comm.timeout_s. Transient memory on
// the trainer is one gathered unit (on GPUs: on the device, gathered in bf16
// from the backend's parameter shards). Knows the sharded model, the engine's
// gather and Comm, not the kernels.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/comm.hpp"
#include "shardlm/config.hpp"
#include "shardlm/runtime.hpp"
#include "train/shard.hpp"

namespace shardlm {

class Engine;
struct TrainSession;

// Order-independent checksum of bf16 values at flat indices [begin, begin + n):
// a sum (mod 2^64) of one mixed word per element, so ranks can hash their own
// slices and add the partial sums. Used by both broadcast paths.
uint64_t bf16_checksum(const uint16_t* values, int64_t begin, int64_t n);

// Host bytes the weight broadcast or the final export hold at most on a trainer
// rank: part of the memory plan. CPU backend: one gathered fp32 unit + its bf16
// copy; CUDA backend: none for the broadcast (the unit is hashed on the GPU).
int64_t output_workspace_bytes(const Config& config, const ModelLayout& layout);
// Device bytes of the weight broadcast on the CUDA backend, per trainer rank:
// one gathered bf16 unit, allocated at the first broadcast and kept until
// finish() (the plan's GPU workspace). 0 elsewhere.
int64_t broadcast_device_bytes(const Config& config, const ModelLayout& layout);

// Where broadcast time goes. Sender (trainer rank 0), summed over its
// broadcasts: the units gathered, rank 0's checksums (and host copy, from a CPU backend), the bytes
// over the communicator (with any wait for a receiver busy sampling). Receiver, for its last step: the bytes over the
// communicator (with the wait for the sender to gather each unit), the copy to
// host memory (GPU path), the checksums, the parameters taken into the model
// (the sink: the InferenceModel, and the GPU decoder's own copy).
struct BroadcastTiming {
  int64_t count = 0;
  double gather_s = 0, host_s = 0, transfer_s = 0, check_s = 0, load_s = 0;
  double total_s() const { return gather_s + host_s + transfer_s + check_s + load_s; }
};

class WeightBroadcaster {
 public:
  // Trainer rank 0 tells the receivers here, at start-up, whether the units
  // come from GPU memory, and picks the device communicator with them.
  WeightBroadcaster(const Config& config, const Runtime& rt, Comm& train_comm);
  ~WeightBroadcaster();
  bool due(int64_t steps_done) const;
  // Before the first step: the inference ranks of an RL job (`shardlm
  // generate`) sample with the trainers' starting weights (seeded, HF or a
  // resumed checkpoint), so they are broadcast once at the start step when the
  // job has any; nothing otherwise.
  void start(TrainSession& session, int64_t start_step);
  // Collective over the trainers: every rank takes part in the gathers. The
  // host paths (CPU backend, filesystem) refresh and read the fp32 masters
  // (session.pull_state()); the GPU communicator path reads the backend's bf16
  // device shards through session.engine and never touches the masters.
  void send(TrainSession& session, int64_t steps_done);
  // Tells the receivers that training is over and how it ended (they exit with
  // the trainers' exit code: 75 after a stop signal, so an MPMD job requeues)
  // and releases the device communicator (before the backend's stream it is ordered on goes).
  void finish(int exit_code);
  // Pinned host bytes of the staged device communicator on this rank (the
  // memory plan's comm staging): trainer rank 0 when it shares a GPU with a receiver.
  int64_t comm_staging_bytes() const;
  // Trainer rank 0, for the end-of-run report: "" when it sent nothing over a
  // communicator, else one line of where the time of its broadcasts went.
  std::string timing_summary() const;

 private:
  void send_over_comm(const ShardedModel& model, int64_t step);
  void send_from_device(Engine& engine, const ModelLayout& layout, int64_t step);
  void send_to_filesystem(const ShardedModel& model, int64_t step);
  void release_gathered_unit();
  // Filesystem path, trainer rank 0: take the receivers' acknowledgements that
  // have arrived; remove the step directories beyond the newest broadcast.keep
  // that every receiver has acknowledged. Returns how many are left.
  void take_acks();
  // The filesystem path, rank 0: removes the step directories of steps after
  // `step` (-1: all) that an earlier launch left, and says so.
  void remove_step_dirs_after(int64_t step);
  size_t retire_step_dirs();
  // Collective over the trainers: while `waiting()` (asked on rank 0, after the
  // acknowledgements that arrived are taken) holds, comm.timeout_s has not
  // passed and (with signal_ends) no stop signal came, poll every 10 ms; the
  // others wait in a broadcast of rank 0's answer. Returns how it ended.
  template <class Waiting>
  int wait_for_receivers(Waiting waiting, bool signal_ends);
  std::string slowest_receiver() const;  // rank 0: "receiver 3 (world rank), last finished step 12"

  const Config& config_;
  const Runtime& rt_;
  Comm& comm_;
  bool enabled_ = false;
  bool device_ = false;              // broadcast.backend = "nccl" on the CUDA backend
  std::string device_kind_;          // rank 0: "nccl" | "mpi" (select_broadcast_comm)
  std::unique_ptr<Comm> host_bcast_;    // rank 0: MPI over rt.broadcast_comm (the device Comm's host side)
  std::unique_ptr<Comm> device_bcast_;  // rank 0: made at the first broadcast, on the backend's stream
  int64_t staging_bytes_ = 0;           // pinned host bytes device_bcast_ holds (staged kind)
  void* gathered_unit_ = nullptr;       // GPU path: one gathered bf16 unit (device), first send to finish()
  int64_t gathered_bytes_ = 0;
  bool tokenizer_noted_ = false;        // rank 0: the filesystem path said where the tokenizer files came from
  // Filesystem path with receivers, rank 0: per receiver (broadcast_comm rank - 1)
  // the last step it finished reading (-1: none yet) and whether it has finished.
  std::vector<int64_t> acked_;
  std::vector<char> receiver_done_;
  bool lagging_ = false;  // waited comm.timeout_s once: its directories are kept, no more waiting until it catches up
  BroadcastTiming timing_;  // rank 0, over a communicator (the host and GPU paths)
};

// The receiving end of the broadcast, one step at a time: `shardlm receive`
// keeps what arrives, `shardlm generate` (the inference ranks of an RL job)
// loads it into its model. Every value is checked against the sender's
// checksum before the sink sees it. Members of rt.broadcast_comm other than
// trainer rank 0; the communicator path is collective over all of them.
class WeightReceiver {
 public:
  // Takes the trainers' start-up hello (and, when they broadcast from GPU
  // memory, binds this rank's GPU). Throws Error when it cannot receive.
  WeightReceiver(const Config& config, Runtime& rt, const ModelLayout& layout);
  ~WeightReceiver();
  // Called with each parameter of a step that arrived, as bf16 values (numel of them).
  using Sink = std::function<void(const ParamInfo& param, const uint16_t* bf16)>;
  // The same where the step arrives in this rank's GPU memory (the trainers
  // broadcast from theirs): each parameter's bf16 values in device memory,
  // valid until the call returns; no copy to the host is made. Optional: a
  // receiver without one gets the host copy through the Sink.
  using DeviceSink = std::function<void(const ParamInfo& param, const void* device_bf16)>;
  enum class Got { Weights, Nothing, Done };
  // The next step's weights into `sink` (Weights), or the end of training
  // (Done: exit_code() is the trainers'). The communicator path always waits
  // for the next message, or with wait = false posts the header's receive
  // (once) and returns Nothing while it has not arrived; once it has, the
  // whole step is received then (an in-flight update between two decode
  // steps). The filesystem path reads the oldest step directory not read yet,
  // or the newest with `newest_only` (the older ones are acknowledged with
  // it); with wait = false it returns Nothing when none is ready. After DONE,
  // acknowledges the end to trainer rank 0.
  Got next(bool wait, bool newest_only, const Sink& sink, const DeviceSink& device_sink = nullptr);
  bool done() const { return done_; }  // the trainers' end was received
  int64_t step() const { return step_; }          // of the last weights received (-1: none)
  int64_t received() const { return received_; }
  int exit_code() const { return exit_code_; }
  const BroadcastTiming& timing() const { return timing_; }  // of the last weights received over the communicator

 private:
  Got next_over_comm(bool wait, const Sink& sink, const DeviceSink& device_sink);
  Got next_from_filesystem(bool wait, bool newest_only, const Sink& sink);
  struct State;
  const Config& config_;
  Runtime& rt_;
  const ModelLayout& layout_;
  const bool filesystem_;
  std::unique_ptr<State> state_;
  int64_t step_ = -1, received_ = 0;
  int exit_code_ = 0;
  bool done_ = false;
  BroadcastTiming timing_;
};

// `shardlm receive DECK [--out DIR]`: receive every broadcast, verify checksums,
// report step, bytes, latency and bandwidth; on the trainer's end write the
// last weights to `out_dir` (if given) as an HF directory (bf16). When the
// trainer broadcasts from GPU memory the receiver binds its GPU (select_device)
// and receives each unit into device memory. Returns the trainers' exit code
// (0, or 75 when a stop signal ended the run): the receiver holds the stop
// handlers too, so a signal does not kill it, and leaves the decision to the
// trainers, who send it with the end of the broadcasts.
int run_receiver(const Config& config, Runtime& rt, const std::string& out_dir);

}  // namespace shardlm
