// canteen::shared_for: a narrow step's big linears split with one helper thread that joins when
// it can, and never waited for when it cannot.
//
// A one-row step runs on one torch thread (worker/engine/threads.py): with an OpenMP team, a
// thread the OS gave to the scheduler or the gateway stalls the whole region at its closing
// barrier. Here the calling thread claims chunks of the range from an atomic counter and so
// does one helper thread, while it is awake; the caller waits only for a chunk the helper has
// claimed and not finished, never for a helper that has not arrived. Which thread computes
// a chunk changes no bit: each chunk computes its outputs alone (lowbit.cpp's blocks).
//
// The helper runs only while set_step_helpers(1) is in force (the worker's narrow steps, set
// from Python), spins briefly between calls of one step and then sleeps on a futex.

#pragma once

#include <cstdint>
#include <functional>

namespace canteen {

// fn(begin, end) over [0, n) in chunks of ``chunk``; on the calling thread alone while no
// helper is on, the range is one chunk, or another call is running.
void shared_for(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn);

// Whether shared_for has a helper now (set_step_helpers(1)).
bool has_step_helper();

}  // namespace canteen
