#include "reader_pool.h"

namespace es {

ReaderPool::ReaderPool(int threads) {
  if (threads < 1) threads = 1;
  for (int i = 0; i <= threads; ++i) workers_.push_back(std::make_unique<Worker>(i == threads));
  for (auto& w : workers_) w->thread = std::thread([this, p = w.get()] { run(p); });
}

ReaderPool::~ReaderPool() {
  cancel_prefetches();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  for (auto& w : workers_) w->cv.notify_one();
  for (auto& w : workers_) w->thread.join();
}

void ReaderPool::run(Worker* w) {
  for (;;) {
    std::function<void()> demand;
    PrefetchTask prefetch;
    {
      std::unique_lock<std::mutex> lk(mu_);
      while (!stop_ && demand_.empty() && (w->demand_only || prefetch_.empty())) {
        w->woken = false;
        if (w->demand_only) {
          demand_idle_ = w;
        } else {
          idle_.push_back(w);
        }
        w->cv.wait(lk, [&] { return stop_ || w->woken; });  // take_idle() unlisted it
      }
      if (!demand_.empty()) {
        demand = std::move(demand_.front());
        demand_.pop_front();
      } else if (!w->demand_only && !prefetch_.empty()) {
        prefetch = std::move(prefetch_.front());
        prefetch_.pop_front();
      } else {
        return;  // stop_ and nothing left
      }
    }
    if (demand) {
      demand();
    } else {
      prefetch(false);
    }
  }
}

ReaderPool::Worker* ReaderPool::take_idle(bool demand) {
  Worker* w = nullptr;
  if (demand && demand_idle_) {
    std::swap(w, demand_idle_);
  } else if (!idle_.empty()) {
    w = idle_.back();
    idle_.pop_back();
  }
  if (w) w->woken = true;
  return w;
}

void ReaderPool::submit_demand(std::vector<std::function<void()>> tasks) {
  std::vector<Worker*> wake;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& t : tasks) {
      demand_.push_back(std::move(t));
      // Busy workers take the rest when they finish: a worker empties the queues.
      if (Worker* w = take_idle(true)) wake.push_back(w);
    }
  }
  for (Worker* w : wake) w->cv.notify_one();
}

void ReaderPool::submit_prefetch(PrefetchTask task) {
  Worker* w;
  {
    std::lock_guard<std::mutex> lk(mu_);
    prefetch_.push_back(std::move(task));
    w = take_idle(false);
  }
  if (w) w->cv.notify_one();
}

size_t ReaderPool::cancel_prefetches() {
  std::deque<PrefetchTask> queued;
  {
    std::lock_guard<std::mutex> lk(mu_);
    queued.swap(prefetch_);
  }
  for (auto& t : queued) t(true);
  return queued.size();
}

}  // namespace es
