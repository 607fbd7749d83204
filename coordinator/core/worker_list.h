#pragma once
// A job's workers in one role (waiting for a generation, or expected back
// after one ended), in order, indexed by worker id: finding, adding and
// counting are O(1), so that a rendezvous of N workers costs O(N) in the
// core rather than O(N²) (issue: the coordinator at cluster scale).
//
// T has `std::string worker_id` and `bool back` (an expected survivor that
// joined again). Callers may change an element's other fields through
// Find() or iteration; `worker_id` and `back` change only through this
// class.

#include <algorithm>
#include <cstddef>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace concord::coordinator {

template <typename T>
class WorkerList {
 public:
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  typename std::vector<T>::iterator begin() { return items_.begin(); }
  typename std::vector<T>::iterator end() { return items_.end(); }
  typename std::vector<T>::const_iterator begin() const {
    return items_.begin();
  }
  typename std::vector<T>::const_iterator end() const { return items_.end(); }

  T* Find(const std::string& worker_id) {
    auto it = index_.find(worker_id);
    return it == index_.end() ? nullptr : &items_[it->second];
  }
  const T* Find(const std::string& worker_id) const {
    auto it = index_.find(worker_id);
    return it == index_.end() ? nullptr : &items_[it->second];
  }

  // Appends `item`; its worker must not be in the list.
  void Add(T item) {
    index_.emplace(item.worker_id, items_.size());
    back_count_ += item.back ? 1 : 0;
    items_.push_back(std::move(item));
  }
  // Removes the worker; false when it is not in the list. O(size).
  bool Remove(const std::string& worker_id) {
    auto it = index_.find(worker_id);
    if (it == index_.end()) return false;
    const size_t i = it->second;
    index_.erase(it);
    back_count_ -= items_[i].back ? 1 : 0;
    items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(i));
    Reindex(i);
    return true;
  }
  void Clear() {
    items_.clear();
    index_.clear();
    back_count_ = 0;
  }
  // Marks an element of this list as back (idempotent).
  void MarkBack(T* item) {
    if (item->back) return;
    item->back = true;
    ++back_count_;
  }
  // Elements marked back.
  size_t back_count() const { return back_count_; }

  // Orders the list stably by `less`, then removes its first `n` elements
  // and returns them in that order.
  template <typename Less>
  std::vector<T> TakeFirst(size_t n, Less less) {
    std::stable_sort(items_.begin(), items_.end(), less);
    n = std::min(n, items_.size());
    std::vector<T> taken(std::make_move_iterator(items_.begin()),
                         std::make_move_iterator(items_.begin() + n));
    items_.erase(items_.begin(), items_.begin() + n);
    index_.clear();
    back_count_ = 0;
    Reindex(0);
    return taken;
  }

 private:
  // Re-indexes the elements from position `first` on.
  void Reindex(size_t first) {
    for (size_t i = first; i < items_.size(); ++i) {
      index_[items_[i].worker_id] = i;
    }
    if (first == 0) {
      back_count_ = static_cast<size_t>(std::count_if(
          items_.begin(), items_.end(), [](const T& t) { return t.back; }));
    }
  }

  std::vector<T> items_;
  std::unordered_map<std::string, size_t> index_;
  size_t back_count_ = 0;
};

}  // namespace concord::coordinator
